"""Decode write-back on the real model (SmolLM2-135M-Instruct, 1 vLLM prefill + 1 vLLM
decode): a three-turn chat whose turns each carry the previous prompt and answer. Turn
k+1, served with the previous answer's KV written back by decode (and taken to the
prefill node), gives exactly the tokens of one monolithic vLLM engine serving the same
conversation, greedy; and it reuses at least what that engine's own prefix cache
reuses (block size 32), the answer's full blocks included.

One stack and one reference for the module, started side by side (two engines and
the reference on two cores compete: nothing here is timed).
"""

import nats
import pytest

from perigee import models
from services.common.cost_fit import PrefillSample, fit_cost_model
from services.common.cost_model import CostModel
from tests.e2e.conftest import make_stack
from tests.e2e.helpers import real_model_marks, worker_stats
from tests.e2e.test_multiturn_writeback import turn

MODEL_DIR = models.default_model_dir()
pytestmark = real_model_marks()

BS = 32
ANSWER = 72  # tokens per answer (ignore_eos): two full blocks and a partial one
FACTS = " ".join(
    f"Fact {i}: the {c} lighthouse is {i * 11 % 37} metres tall and was built in {1800 + i * 7}."
    for i, c in enumerate(("red", "blue", "green", "white", "black", "grey", "gold", "pink") * 2)
)
QUESTIONS = (
    "Repeat the facts above, one per line.",
    "Now repeat them in reverse order.",
    "Which lighthouse is the tallest?",
)


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL_DIR))


@pytest.fixture(scope="module")
def turns(hf):
    """What each turn adds to the conversation, as token ids: the first turn's whole
    chat prompt, then each next user message with the assistant's turn opened."""
    first = hf.apply_chat_template(
        [
            {"role": "system", "content": "You are a careful assistant.\n" + FACTS},
            {"role": "user", "content": QUESTIONS[0]},
        ],
        tokenize=True,
        add_generation_prompt=True,
        return_dict=False,
    )
    nxt = [
        hf(
            f"<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n",
            add_special_tokens=False,
        )["input_ids"]
        for q in QUESTIONS[1:]
    ]
    return [first, *nxt]


@pytest.fixture(scope="module")
def env(turns, tmp_path_factory):
    from services.engine.vllm.conversation import ConversationReference

    ref = ConversationReference(
        {
            "model_dir": str(MODEL_DIR),
            "prefix_caching": True,
            "block_size": BS,
            "max_model_len": 4096,
            "conversations": [[{"prompt": t, "max_tokens": ANSWER} for t in turns]],
        },
        tmp_path_factory.mktemp("reference"),
    ).start()
    cost_model = tmp_path_factory.mktemp("cost") / "analytic.json"
    fit_cost_model(
        [
            PrefillSample(n, p, CostModel().prefill_time(n, p))
            for n in (256, 1024, 4096, 8192)
            for p in (0, n // 4, n // 2)
        ]
    ).save(cost_model)
    s = make_stack(
        tmp_path_factory,
        "multiturn-vllm",
        engine="vllm",
        prefill=1,
        decode=1,
        model_dir=str(MODEL_DIR),
        served_model_name=models.DEFAULT_MODEL_NAME,
        speedup="0.1",
        tbt_slo=1.0,
        store_capacity_blocks=512,
        cost_model=str(cost_model),
        extra_env={"PERIGEE_CACHE_DIR": str(tmp_path_factory.mktemp("cache"))},
    )
    try:
        s.start()
        yield s, ref.result()["conversations"][0]
    finally:
        ref.kill()
        s.stop()


async def test_each_turn_equals_monolithic_vllm_and_reuses_the_previous_answer(env, turns):
    s, expected = env
    nc = await nats.connect(s.nats_url)
    got: list[tuple[list[int], list[int], int]] = []  # (prompt, answer, cached tokens)
    try:
        prompt: list[int] = []
        for add in turns:
            prompt = [*prompt, *got[-1][1], *add] if got else list(add)
            answer, fin = await turn(nc, prompt, ANSWER)
            got.append((prompt, answer, fin.cached_tokens))
    finally:
        await nc.close()
    stats = await worker_stats(s.nats_url, "decode", "decode-0")
    for k, ((prompt, answer, cached), ref) in enumerate(zip(got, expected, strict=True)):
        assert prompt == ref["prompt"], k  # the same conversation so far
        assert answer == ref["tokens"], k  # token for token, greedy
        if k == 0:
            continue
        prev_prompt, prev_answer, _ = got[k - 1]
        # Every full block of the previous prompt + answer with KV (the last sampled
        # token has none) came from the stores, as plain vLLM's prefix cache gives it.
        whole = (len(prev_prompt) + len(prev_answer) - 1) // BS * BS
        assert cached >= whole > len(prev_prompt), (k, cached, whole)
        assert cached >= ref["num_cached_tokens"], (k, cached, ref["num_cached_tokens"])
    assert stats["writeback_blocks"] >= 2 * (ANSWER // BS)
    assert stats["writeback_followed_blocks"] >= 2 * (ANSWER // BS)
    assert stats["writeback_failed"] == stats["writeback_broken"] == 0
