import asyncio
import math

import numpy as np
import pytest

from bus_schemas.requests import SamplingParams
from services.common.cost_model import CostModel
from services.common.hashing import num_blocks
from services.common.kv_layout import KVLayout
from services.common.model_spec import ModelSpec
from services.engine import (
    DecodeJob,
    EngineDeadError,
    EngineError,
    PrefillJob,
    SlotKV,
    make_engine,
    synth,
)
from services.engine.mock import MockEngine

SPEC = ModelSpec.from_dir()
BS = 32
LAYOUT = KVLayout(SPEC, BS)
INF = CostModel(speedup=math.inf)


def fresh_kv(n: int) -> SlotKV:
    slots = [memoryview(bytearray(LAYOUT.block_bytes)) for _ in range(num_blocks(n, BS))]
    return SlotKV(LAYOUT, slots, n)


def copy_kv(src: SlotKV, blocks: int) -> SlotKV:
    """A fresh KV whose first ``blocks`` blocks hold src's bytes (a cache hit)."""
    dst = fresh_kv(src.num_tokens)
    for b in range(blocks):
        dst.slots[b][:] = src.slots[b]
    return dst


def prompt_of(n: int, seed: int = 0) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, SPEC.vocab_size, n)]


def expected_layer(prompt, layer):
    return synth.layer_kv(synth.prefix_hashes(prompt), layer, LAYOUT.row, LAYOUT.dtype)


class RecordingSleep:
    def __init__(self) -> None:
        self.calls: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)


class GatedSleep:
    """Each call records its duration and blocks until the test releases it."""

    def __init__(self) -> None:
        self.calls: list[float] = []
        self.entered: asyncio.Queue[asyncio.Future] = asyncio.Queue()

    async def __call__(self, seconds: float) -> None:
        fut = asyncio.get_running_loop().create_future()
        self.calls.append(seconds)
        await self.entered.put(fut)
        await fut

    async def step(self) -> asyncio.Future:
        return await asyncio.wait_for(self.entered.get(), 5)


async def drain(stream) -> list[int]:
    return [t async for t in stream]


def decode_job(rid, prompt, kv, max_tokens=8, **sampling):
    first = synth.reference_generate(prompt, 1, SPEC.vocab_size, SPEC.eos_token_id)[0]
    return DecodeJob(
        request_id=rid,
        prompt_token_ids=prompt,
        first_token=first,
        sampling=SamplingParams(max_tokens=max_tokens, **sampling),
        kv=kv,
    )


def prefilled(prompt) -> SlotKV:
    kv = fresh_kv(len(prompt))
    hashes = synth.prefix_hashes(prompt)
    for layer in range(SPEC.num_layers):
        kv.write(layer, 0, synth.layer_kv(hashes, layer, LAYOUT.row, LAYOUT.dtype))
    return kv


# -- prefill --


async def test_prefill_writes_deterministic_kv_and_first_token():
    prompt = prompt_of(100)
    eng = MockEngine(SPEC, INF)
    kv = fresh_kv(100)
    first = await eng.prefill(PrefillJob("r", prompt, 0, SamplingParams(), kv))
    assert first == synth.reference_generate(prompt, 1, SPEC.vocab_size, SPEC.eos_token_id)[0]
    for layer in range(SPEC.num_layers):
        np.testing.assert_array_equal(kv.read(layer, 0, 100), expected_layer(prompt, layer))
    # the tail block's unused positions stay untouched
    assert not np.any(kv.block(3, 0)[:, 4:])


@pytest.mark.parametrize(
    ("n", "prefix_blocks"),
    [(100, 1), (100, 2), (96, 3), (2050, 40)],  # 96 = 3 blocks: a full hit; 2050: numpy in a thread
)
async def test_prefix_read_gives_same_token_and_bytes_as_recompute(n, prefix_blocks):
    prompt = prompt_of(n, seed=1)
    eng = MockEngine(SPEC, INF)
    full = fresh_kv(n)
    first_full = await eng.prefill(PrefillJob("a", prompt, 0, SamplingParams(), full))
    hit = copy_kv(full, prefix_blocks)
    p = min(n, prefix_blocks * BS)
    first_hit = await eng.prefill(PrefillJob("b", prompt, p, SamplingParams(), hit))
    assert first_hit == first_full
    assert [bytes(s) for s in hit.slots] == [bytes(s) for s in full.slots]


async def test_prefix_mismatch_is_detected():
    prompt = prompt_of(70, seed=2)
    eng = MockEngine(SPEC, INF)
    full = fresh_kv(70)
    await eng.prefill(PrefillJob("a", prompt, 0, SamplingParams(), full))
    bad = copy_kv(full, 2)
    bad.block(1, 2)[1, 7, 5] += 1.0  # V of token 39 in layer 2
    with pytest.raises(EngineError, match="kv mismatch: layer 2, token 39"):
        await eng.prefill(PrefillJob("b", prompt, 64, SamplingParams(), bad))
    long_prompt = prompt_of(1500, seed=14)
    long_kv = prefilled(long_prompt)
    long_kv.block(40, 1)[0, 3, 0] = 0.0  # token 1283
    with pytest.raises(EngineError, match="kv mismatch: layer 1, token 1283 of 1400"):
        await eng.prefill(PrefillJob("l", long_prompt, 1400, SamplingParams(), long_kv))
    # a prefix that was never written is a mismatch too
    with pytest.raises(EngineError, match="kv mismatch: layer 0"):
        await eng.prefill(PrefillJob("c", prompt, 32, SamplingParams(), fresh_kv(70)))
    # KV of a different prompt is not accepted as this prompt's prefix
    other = fresh_kv(70)
    await eng.prefill(PrefillJob("d", prompt_of(70, seed=3), 0, SamplingParams(), other))
    with pytest.raises(EngineError, match="kv mismatch"):
        await eng.prefill(PrefillJob("e", prompt, 32, SamplingParams(), copy_kv(other, 1)))


async def test_on_layer_runs_in_order_after_each_layer_is_written():
    prompt = prompt_of(50, seed=4)
    kv = fresh_kv(50)
    seen = []

    async def on_layer(layer):
        np.testing.assert_array_equal(kv.read(layer, 0, 50), expected_layer(prompt, layer))
        if layer + 1 < SPEC.num_layers:
            assert not np.any(kv.read(layer + 1, 0, 50))  # next layer not written yet
        seen.append(layer)

    await MockEngine(SPEC, INF).prefill(PrefillJob("r", prompt, 0, SamplingParams(), kv, on_layer))
    assert seen == list(range(SPEC.num_layers))


@pytest.mark.parametrize(("n", "prefix"), [(100, 0), (100, 64), (96, 96)])
async def test_prefill_sleeps_the_cost_model_split_by_layer(n, prefix):
    cost = CostModel(speedup=10.0)
    sleep = RecordingSleep()
    eng = MockEngine(SPEC, cost, sleep=sleep)
    prompt = prompt_of(n, seed=5)
    kv = copy_kv(prefilled(prompt), prefix // BS)
    await eng.prefill(PrefillJob("r", prompt, prefix, SamplingParams(), kv))
    per_layer = cost.prefill_time(n, prefix) / SPEC.num_layers
    assert sleep.calls == ([per_layer] * SPEC.num_layers if per_layer > 0 else [])


async def test_infinite_speedup_never_sleeps():
    sleep = RecordingSleep()
    eng = MockEngine(SPEC, INF, sleep=sleep)
    await eng.start()
    prompt = prompt_of(40, seed=6)
    await eng.prefill(PrefillJob("p", prompt, 0, SamplingParams(), fresh_kv(40)))
    toks = await drain(await eng.add_request(decode_job("d", prompt, prefilled(prompt), 10)))
    assert len(toks) == 9 and sleep.calls == []
    await eng.stop()


async def test_prefill_rejects_bad_jobs():
    eng = MockEngine(SPEC, INF)
    with pytest.raises(EngineError, match="empty prompt"):
        await eng.prefill(PrefillJob("r", [], 0, SamplingParams(), fresh_kv(1)))
    with pytest.raises(EngineError, match="prefix_tokens 50"):
        await eng.prefill(PrefillJob("r", [5] * 40, 50, SamplingParams(), fresh_kv(40)))
    with pytest.raises(EngineError, match="kv holds 32"):
        await eng.prefill(PrefillJob("r", [5] * 40, 0, SamplingParams(), fresh_kv(32)))


# -- decode --


async def test_decode_tokens_follow_the_reference_and_honour_max_tokens():
    eng = MockEngine(SPEC, INF)
    await eng.start()
    prompt = prompt_of(77, seed=7)
    ref = synth.reference_generate(prompt, 12, SPEC.vocab_size, SPEC.eos_token_id)
    stream = await eng.add_request(decode_job("r", prompt, prefilled(prompt), max_tokens=12))
    assert await drain(stream) == ref[1:]
    assert stream.finish_reason == "length"
    one = await eng.add_request(decode_job("s", prompt, prefilled(prompt), max_tokens=1))
    assert await drain(one) == [] and one.finish_reason == "length"
    await eng.stop()


async def test_stop_token_ids_and_eos():
    eng = MockEngine(SPEC, INF)
    await eng.start()
    prompt = prompt_of(33, seed=8)
    ref = synth.reference_generate(prompt, 40, SPEC.vocab_size, SPEC.eos_token_id)
    k = next(i for i in range(2, 40) if ref[i] not in ref[:i])
    stream = await eng.add_request(
        decode_job("r", prompt, prefilled(prompt), max_tokens=40, stop_token_ids=[ref[k]])
    )
    assert await drain(stream) == ref[1 : k + 1] and stream.finish_reason == "stop"
    # the first token may stop the request at once
    first = await eng.add_request(
        decode_job("s", prompt, prefilled(prompt), max_tokens=40, stop_token_ids=[ref[0]])
    )
    assert await drain(first) == [] and first.finish_reason == "stop"
    # an EOS first token stops it unless ignore_eos
    job = decode_job("t", prompt, prefilled(prompt), max_tokens=3)
    job.first_token = SPEC.eos_token_id
    eos = await eng.add_request(job)
    assert await drain(eos) == [] and eos.finish_reason == "stop"
    job = decode_job("u", prompt, prefilled(prompt), max_tokens=3, ignore_eos=True)
    job.first_token = SPEC.eos_token_id
    assert len(await drain(await eng.add_request(job))) == 2
    await eng.stop()


async def test_request_joins_a_running_batch_at_the_next_step():
    cost = CostModel(speedup=100.0)
    sleep = GatedSleep()
    eng = MockEngine(SPEC, cost, sleep=sleep)
    await eng.start()
    pa, pb = prompt_of(40, seed=9), prompt_of(70, seed=10)
    ra = synth.reference_generate(pa, 4, SPEC.vocab_size, SPEC.eos_token_id)
    rb = synth.reference_generate(pb, 3, SPEC.vocab_size, SPEC.eos_token_id)
    sa = await eng.add_request(decode_job("a", pa, prefilled(pa), max_tokens=4))
    step1 = await sleep.step()
    assert sleep.calls == [cost.decode_step_time(1, 41)]
    sb = await eng.add_request(decode_job("b", pb, prefilled(pb), max_tokens=3))
    assert eng.stats().batch_size == 1 and eng.stats().waiting == 1
    step1.set_result(None)
    step2 = await sleep.step()  # b joined at the step boundary
    assert sleep.calls[1] == cost.decode_step_time(2, 42 + 71)
    st = eng.stats()
    assert (st.batch_size, st.waiting, st.kv_tokens) == (2, 0, 113)
    assert st.step_time_s == cost.decode_step_time(2, 113)
    assert await sa.next_batch() == [ra[1]]  # a got its step-1 token, b had none
    step2.set_result(None)
    (await sleep.step()).set_result(None)  # step 3: a finishes (4 tokens), b has 3
    assert await drain(sa) == ra[2:] and sa.finish_reason == "length"
    assert await drain(sb) == rb[1:] and sb.finish_reason == "length"
    assert sleep.calls[2] == cost.decode_step_time(2, 43 + 72)
    assert eng.steps == 3
    await eng.stop()


async def test_max_batch_holds_requests_in_the_waiting_queue():
    sleep = GatedSleep()
    cost = CostModel(speedup=100.0)
    eng = MockEngine(SPEC, cost, max_batch=1, sleep=sleep)
    await eng.start()
    p = prompt_of(10, seed=11)
    sa = await eng.add_request(decode_job("a", p, prefilled(p), max_tokens=2))
    sb = await eng.add_request(decode_job("b", p, prefilled(p), max_tokens=2))
    (await sleep.step()).set_result(None)  # a's only step: a finishes
    (await sleep.step()).set_result(None)  # b's step
    assert sleep.calls == [cost.decode_step_time(1, 11)] * 2
    assert len(await drain(sa)) == 1 and len(await drain(sb)) == 1
    await eng.stop()


async def test_abort_finishes_the_stream_with_abort():
    sleep = GatedSleep()
    eng = MockEngine(SPEC, CostModel(speedup=100.0), sleep=sleep)
    await eng.start()
    p = prompt_of(20, seed=12)
    sa = await eng.add_request(decode_job("a", p, prefilled(p), max_tokens=1000))
    sw = await eng.add_request(decode_job("w", p, prefilled(p), max_tokens=1000))
    step = await sleep.step()
    assert eng.abort("a") and not eng.abort("a") and not eng.abort("nope")
    step.set_result(None)  # the step in flight gives nothing to the aborted request
    assert await drain(sa) == [] and sa.finish_reason == "abort"
    (await sleep.step()).set_result(None)
    step3 = await sleep.step()  # step 2 is done: w has two tokens
    assert eng.stats().batch_size == 1
    assert eng.abort("w")
    step3.set_result(None)
    assert sw.finish_reason == "abort" and len(await drain(sw)) == 2
    await eng.stop()


async def test_decode_verifies_the_prompt_kv():
    eng = MockEngine(SPEC, INF)
    await eng.start()
    p = prompt_of(50, seed=13)
    kv = prefilled(p)
    kv.block(1, 3)[0, 17, 0] = 9.0
    with pytest.raises(EngineError, match="kv mismatch: layer 3, token 49 of 50"):
        await eng.add_request(decode_job("a", p, kv))
    s = await eng.add_request(decode_job("a", p, prefilled(p), max_tokens=2))
    with pytest.raises(EngineError, match="already decoding"):
        await eng.add_request(decode_job("a", p, prefilled(p)))
    assert len(await drain(s)) == 1
    await eng.stop()


async def test_stop_fails_running_streams_and_later_calls():
    eng = MockEngine(SPEC, CostModel(speedup=100.0), sleep=GatedSleep())
    with pytest.raises(EngineDeadError, match="not started"):
        await eng.add_request(decode_job("a", [5], prefilled([5])))
    await eng.start()
    s = await eng.add_request(decode_job("a", [5, 6], prefilled([5, 6]), max_tokens=50))
    await eng.stop()
    with pytest.raises(EngineDeadError, match="engine stopped"):
        await s.next_batch()
    with pytest.raises(EngineDeadError):
        await eng.prefill(PrefillJob("p", [5], 0, SamplingParams(), fresh_kv(1)))


def test_make_engine():
    assert isinstance(make_engine("mock", SPEC, INF, max_batch=4), MockEngine)
    with pytest.raises(ValueError, match="unknown engine"):
        make_engine("tpu", SPEC, INF)
