"""``n`` > 1 through perigee on the real model (issue 25 item 4), asked with the
official ``openai`` client, compared with monolithic vLLM's parallel sampling
(``vllm.LLM``, ``SamplingParams(n=3, seed=...)``: :mod:`tests.e2e.parallel_reference`).

- n=3 gives 3 choices, index 0..2, each a complete answer, for chat and completions,
  streamed and not; usage counts every choice's completion tokens;
- with a seed the choices are reproducible and equal vLLM's children token for token.
  Choices 1 and 2 are sampled on the decode instance from a generator that starts at
  their seed (seed + i), as vLLM's children's do. Choice 0's first token is prefill's,
  from a fresh generator of the seed as vLLM's child 0's; the decode engine's generator
  of the same seed is advanced by that one draw before it samples the second token
  (connector ``skip_draws``), so the rest is child 0's too, and so is a seeded n = 1;
- structured output constrains every choice;
- each choice's logprobs are vLLM's child's (choice 1's first token is sampled on
  decode, choice 0's on prefill);
- the prompt's KV is computed, shipped and read once: prefill ships each layer once
  for the request, one DECODE transaction holds it, the decode engine loads it from the
  slots for sequence 0 alone, and the two other sequences share its pages (vLLM's
  prefix cache, salted per request), computing only the partial block after the shared
  ones (worker and connector counters, not timings), their answers still vLLM's
  children's.

One stack (1 prefill + 1 decode, vLLM) and one reference for the module.
"""

import openai
import pytest

from perigee import models
from tests.e2e.conftest import make_stack
from tests.e2e.helpers import real_model_marks, worker_stats

MODEL_DIR = models.default_model_dir()
pytestmark = real_model_marks()

NAME = models.DEFAULT_MODEL_NAME
LAYERS = 30  # SmolLM2-135M
VLLM_BLOCK = 32  # the decode engine's vLLM block size (CPU)
N, SEED, MAX_TOKENS, TEMP = 3, 1234, 12, 0.9
STORY = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a "
    "small lantern and a notebook in which he recorded the ships that passed"
)
CHAT = [{"role": "user", "content": "Name a colour and say why you like it."}]
SAMPLING = {"n": N, "seed": SEED, "temperature": TEMP, "max_tokens": MAX_TOKENS}
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL_DIR))


@pytest.fixture(scope="module")
def prompts(hf):
    chat = hf.apply_chat_template(
        CHAT, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    story = hf.encode(STORY)
    # Sent once, by the last test: more than three of the decode engine's vLLM blocks.
    long = [*story, *story, *story, *story, *story[:7]]
    return {"story": story, "chat": chat, "long": long}


LOGPROBS = {"n": 2, "seed": 99, "temperature": TEMP, "max_tokens": 6, "logprobs": 2}
TOL = 2e-3  # float32 on both sides; batch shapes differ


@pytest.fixture(scope="module")
def real_env(prompts, tmp_path_factory):
    from tests.e2e.parallel_reference import ParallelReference

    names = [*prompts, "logprobs"]
    ref = ParallelReference(
        {
            "model_dir": str(MODEL_DIR),
            "max_model_len": 8192,
            "requests": [
                *(
                    {"prompt": prompts[k], "sampling": {**SAMPLING, "ignore_eos": True}}
                    for k in prompts
                ),
                {"prompt": prompts["story"], "sampling": {**LOGPROBS, "ignore_eos": True}},
            ],
        },
        tmp_path_factory.mktemp("reference"),
    ).start()
    s = make_stack(
        tmp_path_factory,
        "n-real",
        engine="vllm",
        prefill=1,
        decode=1,
        model_dir=str(MODEL_DIR),
        served_model_name=NAME,
        speedup="0.1",
        tbt_slo=1.0,
        store_capacity_blocks=512,
        extra_env={"PERIGEE_CACHE_DIR": str(tmp_path_factory.mktemp("cache"))},
    )
    try:
        s.start()
        results = dict(zip(names, ref.result()["results"], strict=True))
        yield s, results
    finally:
        ref.kill()
        s.stop()


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)


def _check_against_vllm(texts: list[str], seqs: list[list[int]], hf) -> None:
    # vLLM's children token for token (as text: the API's answer)
    assert texts == [hf.decode(s, skip_special_tokens=True) for s in seqs]


async def _completion(c, prompt: list[int], stream: bool) -> tuple[list[str], list[str], int]:
    kw = {"model": NAME, "prompt": prompt, **SAMPLING, "extra_body": NO_EOS}
    if not stream:
        out = await c.completions.create(**kw)
        got = sorted(out.choices, key=lambda ch: ch.index)
        assert [ch.index for ch in got] == list(range(N))
        return (
            [ch.text for ch in got],
            [ch.finish_reason for ch in got],
            out.usage.completion_tokens,
        )
    texts, finishes, used = [""] * N, [None] * N, 0
    async for ch in await c.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}
    ):
        for choice in ch.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
        if ch.usage:
            used = ch.usage.completion_tokens
    return texts, finishes, used


async def _chat(c, stream: bool) -> tuple[list[str], list[str], int]:
    kw = {"model": NAME, "messages": CHAT, **SAMPLING, "extra_body": NO_EOS}
    if not stream:
        out = await c.chat.completions.create(**kw)
        got = sorted(out.choices, key=lambda ch: ch.index)
        assert [ch.index for ch in got] == list(range(N))
        texts = [ch.message.content for ch in got]
        return texts, [ch.finish_reason for ch in got], out.usage.completion_tokens
    texts, finishes, used = [""] * N, [None] * N, 0
    async for ch in await c.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}
    ):
        for choice in ch.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
        if ch.usage:
            used = ch.usage.completion_tokens
    return texts, finishes, used


@pytest.mark.parametrize("stream", [False, True])
async def test_completion_n3_seeded_equals_vllm_children(real_env, prompts, hf, stream):
    s, ref = real_env
    async with client(s.url) as c:
        texts, finishes, used = await _completion(c, prompts["story"], stream)
        again, _, _ = await _completion(c, prompts["story"], stream)
    assert finishes == ["length"] * N
    assert used == N * MAX_TOKENS  # every choice's tokens
    assert again == texts  # reproducible with the seed
    assert len(set(texts)) == N  # three different answers
    _check_against_vllm(texts, ref["story"]["seqs"], hf)


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_n3_seeded_equals_vllm_children(real_env, hf, stream):
    s, ref = real_env
    async with client(s.url) as c:
        texts, finishes, used = await _chat(c, stream)
        again, _, _ = await _chat(c, stream)
    assert finishes == ["length"] * N
    assert used == N * MAX_TOKENS
    assert again == texts
    _check_against_vllm(texts, ref["chat"]["seqs"], hf)


async def test_each_choice_has_vllms_logprobs(real_env, prompts, hf):
    # choice 1's first token is sampled on decode, choice 0's on prefill: both as vLLM's
    s, ref = real_env
    r = ref["logprobs"]
    async with client(s.url) as c:
        out = await c.completions.create(
            model=NAME, prompt=prompts["story"], **LOGPROBS, extra_body=NO_EOS
        )
    got = sorted(out.choices, key=lambda ch: ch.index)
    assert len(got) == 2
    for ch, seq, lps in zip(got, r["seqs"], r["logprobs"], strict=True):
        assert ch.text == hf.decode(seq, skip_special_tokens=True)
        assert len(ch.logprobs.token_logprobs) == len(seq) == 6
        for i, tok in enumerate(seq):
            want = dict((t, lp) for t, lp in lps[i])[tok]
            assert ch.logprobs.token_logprobs[i] == pytest.approx(want, abs=TOL)


async def test_structured_output_constrains_every_choice(real_env):
    # the grammar runs on prefill for choice 0's first token and afresh on decode for
    # the others' (their first token is sampled there)
    s, _ = real_env
    colours = ["red", "green", "blue", "yellow"]
    async with client(s.url) as c:
        out = await c.chat.completions.create(
            model=NAME,
            messages=CHAT,
            n=4,
            seed=5,
            temperature=1.5,
            max_tokens=8,
            extra_body={"structured_outputs": {"choice": colours}},
        )
    got = sorted(out.choices, key=lambda ch: ch.index)
    assert [ch.index for ch in got] == [0, 1, 2, 3]
    assert all(ch.message.content in colours for ch in got), [ch.message.content for ch in got]


async def test_seeded_n1_equals_vllms_first_child(real_env, prompts, hf):
    # vLLM's child 0 of n=3 with seed s is its n=1 answer with seed s (seed + 0)
    s, ref = real_env
    d0 = await worker_stats(s.nats_url, "decode", "decode-0")
    async with client(s.url) as c:
        out = await c.completions.create(
            model=NAME,
            prompt=prompts["story"],
            **{**SAMPLING, "n": 1},
            extra_body=NO_EOS,
        )
    d1 = await worker_stats(s.nats_url, "decode", "decode-0")
    want = hf.decode(ref["story"]["seqs"][0], skip_special_tokens=True)
    assert out.choices[0].text == want
    # the decode engine's generator went on from prefill's one draw
    assert d1["connector_draws_skipped"] - d0.get("connector_draws_skipped", 0) == 1


async def test_prompt_kv_is_computed_shipped_and_read_once(real_env, prompts, hf):
    s, ref = real_env
    prompt = prompts["long"]  # no earlier test sent it: nothing cached
    n = len(prompt)
    shared = (n - 1) // VLLM_BLOCK * VLLM_BLOCK  # the full blocks before the last position
    assert shared >= 3 * VLLM_BLOCK
    p0 = await worker_stats(s.nats_url, "prefill", "prefill-0")
    d0 = await worker_stats(s.nats_url, "decode", "decode-0")
    async with client(s.url) as c:
        out = await c.completions.create(model=NAME, prompt=prompt, **SAMPLING, extra_body=NO_EOS)
    got = sorted(out.choices, key=lambda ch: ch.index)
    p1 = await worker_stats(s.nats_url, "prefill", "prefill-0")
    d1 = await worker_stats(s.nats_url, "decode", "decode-0")
    _check_against_vllm([ch.text for ch in got], ref["long"]["seqs"], hf)

    def delta(a: dict, b: dict, key: str) -> int:
        return b.get(key, 0) - a.get(key, 0)

    # Prefill: the prompt computed once, each layer shipped once (as for n = 1).
    assert delta(p0, p1, "tasks_done") == 1
    assert delta(p0, p1, "vllm_prompt_tokens_computed") == n
    assert delta(p0, p1, "connector_layers_shipped") == LAYERS
    # Decode: one task, one transaction's KV, read from its slots once: sequence 0 loads
    # every prompt position (each vLLM block of each layer copied once)...
    assert delta(d0, d1, "kv_tokens_loaded") == n
    assert delta(d0, d1, "sequences_sharing_kv") == N - 1
    assert delta(d0, d1, "vllm_requests") == N
    assert delta(d0, d1, "connector_loads") == 1
    assert delta(d0, d1, "connector_tokens_loaded") == n
    assert delta(d0, d1, "connector_layer_blocks_loaded") == -(-n // VLLM_BLOCK) * LAYERS
    # ... and the 2 others find its full blocks in the engine's pages, computing the
    # partial block after them (sequence 0 computes only its first token's position).
    assert delta(d0, d1, "connector_tokens_cached") == (N - 1) * shared
    assert delta(d0, d1, "vllm_prompt_tokens_computed") == 1 + (N - 1) * (n - shared)
