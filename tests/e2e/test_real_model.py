"""Exactness through HTTP on the real model: SmolLM2-135M-Instruct (``make install``
prepares it), 2 vLLM prefill + 1 decode, asked through the gateway with the official
``openai`` client. Every answer must equal one monolithic vLLM engine's greedy output
for the same prompts, token for token: the gateway renders the chat template and
tokenizes, prefill runs on P, the KV crosses the stores, decode runs on D, the gateway
detokenizes and stops on ``<|im_end|>``. The reference's prompt ids come from
transformers' own ``apply_chat_template`` (not perigee's), its text from transformers'
``decode``; it runs with ``ignore_eos`` and is cut after its first EOS.

Long prompts share a ~1k-token system message: the second one on the same instance loads
it from its store, the third is placed on the other prefill instance (the first one is
kept busy) and pulls it from there. One stack and one reference for the module.
"""

import asyncio
import time
import uuid

import nats
import openai
import pytest

from bus_schemas import subjects
from bus_schemas.codec import decode, encode
from bus_schemas.load import PrefillLoad
from bus_schemas.requests import Accepted, GenerateRequest, SamplingParams, StreamEvent
from perigee import models
from services.common.cost_fit import PrefillSample, fit_cost_model
from services.common.cost_model import CostModel
from services.common.hashing import block_hashes
from tests.e2e.conftest import make_stack
from tests.e2e.helpers import KVEventWatcher, chat_ids, real_model_marks, worker_stats

MODEL_DIR = models.default_model_dir()
pytestmark = real_model_marks()

NAME = models.DEFAULT_MODEL_NAME
BS = 32
MAX_TOKENS = 24
EOS = 2  # <|im_end|>
PREFILLS = ("prefill-0", "prefill-1")
DOC = " ".join(
    f"Survey station {i} lies {i * 7 % 31} km north of the river and "
    f"records {i * 13 % 47} birds a day."
    for i in range(45)
)

CHATS = {
    "france": [{"role": "user", "content": "What is the capital of France?"}],
    "haiku": [{"role": "user", "content": "Write a haiku about the moon."}],
    "colors": [
        {"role": "system", "content": "Answer in one short sentence."},
        {"role": "user", "content": "Name three primary colors. 🎨"},
    ],
}
LONG = {
    name: [
        {"role": "system", "content": "Use this survey.\n" + DOC},
        {"role": "user", "content": q},
    ]
    for name, q in (
        ("first", "Which station records the most birds?"),
        ("local", "How far north is station 3?"),
        ("pulled", "Summarise the survey in one sentence."),
    )
}


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL_DIR))


@pytest.fixture(scope="module")
def prompts(hf):
    return chat_ids(hf, {**CHATS, **LONG})


@pytest.fixture(scope="module")
def real_env(prompts, tmp_path_factory):
    """The stack and the monolithic reference, started side by side."""
    from services.engine.vllm.reference import Reference

    names = list(prompts)
    ref = Reference(
        {
            "model_dir": str(MODEL_DIR),
            "prefix_caching": False,
            "max_model_len": 8192,
            "requests": [{"prompt": prompts[k], "max_tokens": MAX_TOKENS} for k in names],
        },
        tmp_path_factory.mktemp("reference"),
    ).start()
    # One hand-given cost model for both prefill instances (as test_vllm_stack): placement
    # follows caches and queues, not which instance measured faster in its warm-up.
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
        "real",
        engine="vllm",
        prefill=2,
        decode=1,
        model_dir=str(MODEL_DIR),
        served_model_name=NAME,
        speedup="0.1",
        tbt_slo=1.0,
        store_capacity_blocks=512,
        cost_model=str(cost_model),
        extra_env={"PERIGEE_CACHE_DIR": str(tmp_path_factory.mktemp("cache"))},
    )
    try:
        s.start()
        expected = {}
        for k, r in zip(names, ref.result()["results"], strict=True):
            toks = r["tokens"]
            expected[k] = toks[: toks.index(EOS) + 1] if EOS in toks else toks
        yield s, expected
    finally:
        ref.kill()
        s.stop()


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


async def ask(c: openai.AsyncOpenAI, messages: list[dict], stream: bool = False, model: str = NAME):
    """(text, finish_reason, usage) of one greedy chat request."""
    kw = {"model": model, "messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS}
    if not stream:
        r = await c.chat.completions.create(**kw)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage
    parts, finish, use = [], None, None
    async for ch in await c.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}
    ):
        if ch.choices:
            parts.append(ch.choices[0].delta.content or "")
            finish = ch.choices[0].finish_reason or finish
        if ch.usage is not None:
            use = ch.usage
    return "".join(parts), finish, use


def check(hf, name: str, got, expected: list[int], prompt: list[int]) -> None:
    text, finish, use = got
    assert text == hf.decode(expected, skip_special_tokens=True), name
    assert use.completion_tokens == len(expected), name
    assert use.prompt_tokens == len(prompt), name
    assert finish == ("stop" if expected[-1] == EOS else "length"), name


async def test_chat_answers_equal_monolithic_vllm(real_env, hf, prompts):
    s, expected = real_env
    async with client(s.url) as c:
        got = {
            "france": await ask(c, CHATS["france"]),
            "haiku": await ask(c, CHATS["haiku"], stream=True),
            "colors": await ask(c, CHATS["colors"], stream=True),
        }
    assert got["france"][0] == "The capital of France is Paris."
    assert len({tuple(expected[k]) for k in CHATS}) == len(CHATS)  # real, prompt-dependent text
    assert any(expected[k][-1] == EOS for k in CHATS)  # and a turn ended on <|im_end|>
    for name, g in got.items():
        check(hf, name, g, expected[name], prompts[name])


async def wait_idle(nc, instance: str) -> None:
    """Until ``instance`` reports an empty queue, in a report taken after this call."""
    since, idle = time.time(), asyncio.Event()

    async def cb(msg) -> None:
        load = decode(msg.data, PrefillLoad)
        if load.queue_len == 0 and load.ts > since:
            idle.set()

    sub = await nc.subscribe(subjects.load_report("prefill", instance), cb=cb)
    try:
        await asyncio.wait_for(idle.wait(), 30)
    finally:
        await sub.unsubscribe()


async def bus_request(nc, prompt: list[int], placed: asyncio.Event) -> str:
    """A 1-token request on the bus, to keep an instance busy; returns where it ran."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    req = GenerateRequest(
        request_id=uuid.uuid4().hex,
        prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=1, ignore_eos=True),
    )
    await nc.publish(subjects.REQUESTS, encode(req), reply=inbox)
    instance = ""
    try:
        while True:
            ev = decode((await sub.next_msg(timeout=120)).data, StreamEvent)
            if isinstance(ev, Accepted):
                instance = ev.prefill_instance
                placed.set()
            elif type(ev).__name__ in ("Finished", "Error"):
                assert type(ev).__name__ == "Finished", ev
                return instance
    finally:
        await sub.unsubscribe()


async def prefill_stats(s) -> dict[str, dict[str, int]]:
    return {i: await worker_stats(s.nats_url, "prefill", i) for i in PREFILLS}


def grew(after: dict, before: dict, key: str) -> dict[str, int]:
    return {i: after[i].get(key, 0) - before[i].get(key, 0) for i in PREFILLS}


async def test_shared_prefix_cached_and_pulled_equals_monolithic_vllm(real_env, hf, prompts):
    s, expected = real_env
    first, local, pulled = (prompts[k] for k in LONG)
    common = next(i for i, (a, b) in enumerate(zip(first, pulled, strict=False)) if a != b)
    shared = common // BS * BS  # full blocks of the system message
    assert shared >= 30 * BS and local[:shared] == first[:shared]
    nc = await nats.connect(s.nats_url)
    watcher = await KVEventWatcher().start(s.nats_url)
    try:
        async with client(s.url) as c:
            before = await prefill_stats(s)
            r_first = await ask(c, LONG["first"])
            await watcher.wait_for(block_hashes(first[:shared], BS), timeout=60)
            after = await prefill_stats(s)
            a = max(PREFILLS, key=lambda i: grew(after, before, "computed_tokens")[i])
            b = next(i for i in PREFILLS if i != a)
            r_local = await ask(c, LONG["local"], stream=True)
            await wait_idle(nc, a)
            b_before = await worker_stats(s.nats_url, "prefill", b)
            # Keep A busy: a 4k prompt on the same prefix goes to A (its blocks are local);
            # while A computes it, pulling the prefix to B beats waiting for A.
            placed = asyncio.Event()
            filler = hf("Station notes. " * 800, add_special_tokens=False)["input_ids"]
            busy = asyncio.create_task(bus_request(nc, first[:shared] + filler[:3000], placed))
            await asyncio.wait_for(placed.wait(), 60)
            r_pulled = await ask(c, LONG["pulled"])
            busy_on = await busy
            b_after = await worker_stats(s.nats_url, "prefill", b)
    finally:
        await watcher.close()
        await nc.close()
    for name, got in zip(LONG, (r_first, r_local, r_pulled), strict=True):
        check(hf, name, got, expected[name], prompts[name])
    assert r_first[2].prompt_tokens_details.cached_tokens == 0
    assert r_local[2].prompt_tokens_details.cached_tokens == shared
    assert busy_on == a
    assert r_pulled[2].prompt_tokens_details.cached_tokens == shared
    assert (
        b_after.get("remote_tokens_pulled", 0) - b_before.get("remote_tokens_pulled", 0) == shared
    )
    assert (
        b_after.get("vllm_prompt_tokens_computed", 0)
        - b_before.get("vllm_prompt_tokens_computed", 0)
        == len(pulled) - shared
    )
