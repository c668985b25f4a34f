"""Decode write-back without a bus: the mock engine hands its answer blocks over as they
fill, AnswerWriteBack commits them into a real BlockPool (behind a StoreTx stand-in
with bytearray slots) under the chained hashes of prompt + answer."""

import math

import numpy as np
import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from bus_schemas.control import Refused, TxAllocate, TxRole
from bus_schemas.kv_events import BlockStored
from bus_schemas.requests import GenerateRequest, Retention, SamplingParams
from services.common.clock import ManualClock
from services.common.cost_model import CostModel
from services.common.hashing import block_hashes
from services.common.kv_layout import KVLayout
from services.common.model_spec import ModelSpec
from services.common.store_tx import AllocationRound
from services.decode.writeback import COUNTERS, AnswerWriteBack
from services.engine import DecodeJob, SlotKV, make_engine, synth
from services.store.pool.block_pool import BlockPool
from tests.unit.conftest_fakestore import write_expected

BS = 16
NODE = "d0"


class PoolStore:
    """Nodes' stores in-process: a real BlockPool each, bytearray slots; StoreTx's calls
    go to the node they name, ``ship_layer`` copies between them. ``self`` is NODE."""

    def __init__(self, layout: KVLayout, capacity: int = 64, node: str = NODE, net=None) -> None:
        self.layout = layout
        self.node = node
        self.net = {} if net is None else net
        self.net[node] = self
        self.pool = BlockPool(capacity, BS, ManualClock(), id_prefix=f"{node}-")
        self.mem = bytearray(capacity * layout.block_bytes)
        self.allocs: list[TxAllocate] = []
        self.ships: list[tuple[str, list[int]]] = []
        self.traces: list[int] = []  # the trace id current at each allocate and commit

    def peer(self, node: str) -> "PoolStore":
        return PoolStore(self.layout, node=node, net=self.net)

    async def ship_layer(self, src, dst, layer, blocks, layer_bytes, layer_offset) -> None:
        assert (layer, layer_offset, layer_bytes) == (0, 0, self.layout.block_bytes)
        far = self.net[dst.node]
        assert far.pool.check_write(dst.tx_id, [dst.slots[b] for b in blocks]) is None
        for b in blocks:
            far.slot(dst.slots[b])[:] = self.slot(src.slots[b])
        self.ships.append((dst.node, list(blocks)))

    def slot(self, i: int) -> memoryview:
        bb = self.layout.block_bytes
        return memoryview(self.mem)[i * bb : (i + 1) * bb]

    async def attached(self, tx) -> None:
        """One incarnation."""

    async def allocate(self, jobs):
        self.traces.append(trace.get_current_span().get_span_context().trace_id)
        out = AllocationRound()
        for role, (node, msg) in jobs.items():
            st = self.net[node]
            st.allocs.append(msg)
            got = st.pool.allocate(msg)
            if isinstance(got, Refused):
                out.refused[role] = got.reason
            else:
                out.handles[role] = (node, _handle(got, node))
        return out

    async def commit(self, node: str, tx_id: str, request_id: str) -> bool:
        self.traces.append(trace.get_current_span().get_span_context().trace_id)
        return not isinstance(self.net[node].pool.commit(tx_id, request_id), Refused)

    async def abort(self, node: str, tx_id: str, request_id: str, reason: str) -> bool:
        return not isinstance(self.net[node].pool.abort(tx_id), Refused)

    def cache_prompt(self, prompt: list[int]) -> None:
        """What the decode_tx commit leaves: the prompt's full blocks, with their KV."""
        hashes = block_hashes(prompt, BS)
        a = self.pool.allocate(
            TxAllocate(
                request_id="p", role=TxRole.DECODE, block_hashes=hashes, num_tokens=len(prompt)
            )
        )
        write_expected(
            SlotKV(self.layout, [self.slot(s) for s in a.slots], len(prompt)),
            prompt,
            0,
            len(prompt),
        )
        self.pool.commit(a.tx_id)
        self.pool.take_events()


def _handle(a, node):
    from bus_schemas.control import TxHandle

    return TxHandle(
        tx_id=a.tx_id,
        node=node,
        epoch=1,
        slots=a.slots,
        hit_blocks=a.hit_blocks,
        shm_name="",
        data_addr="",
        block_bytes=0,
    )


@pytest.fixture
def spec():
    return ModelSpec.from_dir()


@pytest.fixture
def layout(spec):
    return KVLayout(spec, BS)


async def decode(
    spec,
    layout,
    store: PoolStore,
    prompt,
    max_tokens,
    retention=Retention.DEFAULT,
    follow=None,
    ctx=None,
    **kw,
):
    """Decode ``prompt`` on the mock engine with write-back into ``store``; the answer."""
    engine = make_engine("mock", spec, CostModel(speedup=math.inf))
    await engine.start()
    req = GenerateRequest(
        request_id="r1",
        prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=max_tokens),
        block_size=BS,
        block_hashes=block_hashes(prompt, BS),
        retention=retention,
    )
    counters = dict.fromkeys(COUNTERS, 0)
    # Made in the request's trace (``ctx``), as the decode worker makes it; the engine's
    # loop and everything after run in none.
    token = otel_context.attach(ctx) if ctx is not None else None
    wb = AnswerWriteBack(
        req,
        node=NODE,
        store=store,
        store_tx=store,
        block_size=BS,
        block_bytes=layout.block_bytes,
        counters=counters,
        follow_node=follow,
        **kw,
    )
    if token is not None:
        otel_context.detach(token)
    first = synth.reference_generate(prompt, 1, spec.vocab_size, spec.eos_token_id)[0]
    wb.add_tokens([first])
    kv = SlotKV(
        layout,
        [memoryview(bytearray(layout.block_bytes)) for _ in range(-(-len(prompt) // BS))],
        len(prompt),
    )
    write_expected(kv, prompt, 0, len(prompt))
    stream = await engine.add_request(
        DecodeJob("r1", prompt, first, req.sampling, kv, on_block=wb.on_block)
    )
    answer = [first]
    wb.prompt_committed()
    while batch := await stream.next_batch():
        answer += batch
        wb.add_tokens(batch)
    await wb.finish()
    if wb.catch_up is not None:
        await wb.catch_up
    await engine.stop()
    return answer, counters


def prompt_of(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 1000, n)]


async def test_answer_blocks_are_stored_under_prompt_plus_answer_hashes_with_the_engines_kv(
    spec, layout
):
    store = PoolStore(layout)
    prompt = prompt_of(40, 1)  # block 2 holds the prompt's tail
    store.cache_prompt(prompt)
    answer, counters = await decode(spec, layout, store, prompt, max_tokens=30)
    conv = prompt + answer
    # The last sampled token never had KV: 69 of 70 positions do, 4 full blocks.
    full = (len(conv) - 1) // BS
    assert full == 4
    chain = block_hashes(conv, BS)[:full]
    assert [store.pool.is_cached(h) for h in chain] == [True] * full
    assert counters["writeback_blocks"] == 2 and store.pool.counters["answer_blocks"] == 2
    events = store.pool.take_events()
    assert [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes] == chain[2:]
    # The bytes are the engine's KV of those positions (what prefill would compute).
    expect = SlotKV(
        layout, [memoryview(bytearray(layout.block_bytes)) for _ in range(full)], full * BS
    )
    write_expected(expect, conv, 0, full * BS)
    for j in (2, 3):
        assert store.slot(store.pool.slot_of(chain[j])) == expect.slots[j], j
    # One transaction per block as it filled (the second after the first committed).
    assert [len(a.block_hashes) for a in store.allocs] == [3, 4]
    assert all(a.answer and a.role == TxRole.DECODE for a in store.allocs)


async def test_the_write_back_goes_in_its_requests_trace(spec, layout):
    """Its writes start from the engine's block callbacks, which run in no request's
    trace: the store's allocations and commits are in the request's all the same."""
    store = PoolStore(layout)
    prompt = prompt_of(40, 1)
    store.cache_prompt(prompt)
    span = NonRecordingSpan(SpanContext(0xC0FFEE, 0xBEEF, False, TraceFlags(1)))
    _, counters = await decode(
        spec, layout, store, prompt, max_tokens=30, ctx=trace.set_span_in_context(span)
    )
    assert counters["writeback_blocks"] == 2
    assert len(store.traces) == 4 and set(store.traces) == {0xC0FFEE}  # 2 allocs, 2 commits


async def test_a_chain_missing_its_prompt_writes_nothing(spec, layout):
    store = PoolStore(layout)
    prompt = prompt_of(40, 2)  # the prompt's blocks were never committed here
    _, counters = await decode(spec, layout, store, prompt, max_tokens=30)
    assert counters["writeback_broken"] == 1 and counters["writeback_blocks"] == 0
    assert store.pool.cached_blocks == 0 and store.pool.open_txs() == []


async def test_ephemeral_answers_are_not_written_back(spec, layout):
    store = PoolStore(layout)
    prompt = prompt_of(40, 3)
    store.cache_prompt(prompt)
    _, counters = await decode(spec, layout, store, prompt, 30, retention=Retention.EPHEMERAL)
    assert store.allocs == [] and counters["writeback_txs"] == 0


async def test_hits_on_written_back_blocks_are_counted_by_tier(spec, layout):
    store = PoolStore(layout)
    prompt = prompt_of(40, 4)
    store.cache_prompt(prompt)
    answer, _ = await decode(spec, layout, store, prompt, max_tokens=30)
    turn2 = prompt + answer + prompt_of(20, 5)
    a = store.pool.allocate(
        TxAllocate(
            request_id="t2",
            role=TxRole.PREFILL,
            block_hashes=block_hashes(turn2, BS),
            num_tokens=len(turn2),
        )
    )
    assert a.hit_blocks == 4  # the prompt's 2 blocks and the answer's 2
    assert store.pool.counters["answer_hits_dram"] == 2


async def test_the_answer_follows_the_prompt_to_the_prefill_node(spec, layout):
    store = PoolStore(layout)
    p0 = store.peer("p0")
    prompt = prompt_of(40, 6)
    store.cache_prompt(prompt)
    p0.cache_prompt(prompt)  # the prefill node committed the prompt it computed
    answer, counters = await decode(spec, layout, store, prompt, max_tokens=30, follow="p0")
    chain = block_hashes(prompt + answer, BS)[:4]
    assert [p0.pool.is_cached(h) for h in chain] == [True] * 4
    for j in (2, 3):  # the same bytes as the decode node's, shipped over
        assert p0.slot(p0.pool.slot_of(chain[j])) == store.slot(store.pool.slot_of(chain[j]))
    assert store.ships == [("p0", [2]), ("p0", [3])]
    assert counters["writeback_followed_blocks"] == 2 and p0.pool.open_txs() == []
    # The next turn finds the whole conversation on the prefill node.
    turn2 = prompt + answer + prompt_of(20, 7)
    assert p0.pool.prefix_hits(block_hashes(turn2, BS)) == 4


async def test_a_prefill_node_without_the_prompt_gets_nothing(spec, layout):
    store = PoolStore(layout)
    p0 = store.peer("p0")
    prompt = prompt_of(40, 8)
    store.cache_prompt(prompt)  # p0 never commits the prompt: nothing follows
    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)

    answer, counters = await decode(
        spec, layout, store, prompt, max_tokens=30, follow="p0", sleep=sleep, retry_s=(1, 2)
    )
    assert slept == [1, 2]  # asked again in the background, then given up
    assert counters["writeback_followed_blocks"] == 0 and p0.pool.cached_blocks == 0
    assert p0.pool.open_txs() == [] and store.pool.open_txs() == []
    assert counters["writeback_blocks"] == 2  # this node has them all the same


async def test_a_prefill_node_that_commits_the_prompt_late_gets_the_answer_after(spec, layout):
    store = PoolStore(layout)
    p0 = store.peer("p0")
    prompt = prompt_of(40, 9)
    store.cache_prompt(prompt)

    async def sleep(s: float) -> None:  # meanwhile the conductor commits the prompt there
        p0.cache_prompt(prompt)

    answer, counters = await decode(
        spec, layout, store, prompt, max_tokens=30, follow="p0", sleep=sleep, retry_s=(1, 2)
    )
    chain = block_hashes(prompt + answer, BS)[:4]
    assert [p0.pool.is_cached(h) for h in chain] == [True] * 4
    assert counters["writeback_followed_blocks"] == 2 and store.ships == [("p0", [2, 3])]


def test_decode_writes_back_unless_told_not_to(layout):
    from services.decode.__main__ import parse_args
    from services.worker.settings import settings_from_args

    on = settings_from_args(parse_args([]), layout, CostModel())
    off = settings_from_args(parse_args(["--no-write-back"]), layout, CostModel())
    assert (on.write_back, off.write_back) == (True, False)
