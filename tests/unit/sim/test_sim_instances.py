"""Simulator building blocks by hand: the event loop, a decode instance's continuous
batching (segments, joins at step boundaries, TBT from the step log), a prefill
instance's FIFO and chunked prefill, links."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from perigee.sim.cluster import Link
from perigee.sim.events import EventLoop
from perigee.sim.instances import DecodeInstance, PrefillInstance, top_mean
from perigee.sim.request import SimRequest
from services.common.cost_model import CostModel
from services.prefill.queue import chunked_prefill_time

# 1 KV byte per token, prefill 1 flop per token at 20 flop/s (0.05 s/token), decode step
# = context tokens / 1000 s, transfers free.
TOY = CostModel(
    layers=1,
    d=1,
    a=0.0,
    b=1.0,
    gqa=2,
    elem_bytes=1,
    gpu_flops=20.0,
    hbm_bw=1000.0,
    weight_bytes=0.0,
    nic_bw=math.inf,
)


def req(i: int, n: int, out: int, t: float = 0.0) -> SimRequest:
    return SimRequest(rid=f"r{i}", index=i, arrival=t, num_tokens=n, output_tokens=out, hashes=[])


def test_event_loop_runs_in_time_then_schedule_order():
    loop = EventLoop()
    seen = []
    loop.at(2.0, lambda: seen.append(("b", loop.now())))
    loop.at(1.0, lambda: seen.append(("a", loop.now())))
    loop.at(2.0, lambda: seen.append(("c", loop.now())))
    loop.at(1.0, lambda: loop.after(0.5, lambda: seen.append(("d", loop.now()))))
    loop.run()
    assert seen == [("a", 1.0), ("d", 1.5), ("b", 2.0), ("c", 2.0)]
    assert loop.clock.now() == 2.0 and loop.events_run == 5


def test_event_loop_stops_at_until():
    loop = EventLoop()
    seen = []
    loop.at(5.0, seen.append, 5)
    loop.run(until=3.0)
    assert seen == [] and loop.now() == 3.0 and loop.pending() == 1


def test_lone_request_tbt_is_the_cost_model_step_time():
    loop = EventLoop()
    done = []
    dec = DecodeInstance("D", "n1", loop, TOY, done.append)
    r = req(0, 100, 2)
    r.first_token = 0.0
    loop.at(0.0, dec.add, r)
    loop.run()
    assert done == [r]
    assert r.tbt_s == TOY.decode_step_time(1, 101) == 0.101
    assert r.finished == 0.101 and dec.tokens == 1


def test_batch_tbt_follows_batch_composition():
    loop = EventLoop()
    dec = DecodeInstance("D", "n1", loop, TOY, lambda r: None)
    a, b = req(0, 100, 3), req(1, 200, 3)
    for r in (a, b):
        r.first_token = 0.0
        loop.at(0.0, dec.add, r)
    loop.run()
    # both join step 0; steps see contexts 101+201 then 102+202; TBT = the longer gap
    assert (a.join_step, b.join_step) == (0, 0)
    assert a.tbt_s == b.tbt_s == pytest.approx(TOY.decode_step_time(2, 304), rel=1e-12)
    assert a.finished == pytest.approx(0.302 + 0.304, rel=1e-12)


def test_arrival_mid_step_joins_at_the_next_boundary():
    loop = EventLoop()
    dec = DecodeInstance("D", "n1", loop, TOY, lambda r: None)
    a, b = req(0, 1000, 4), req(1, 500, 2)
    a.first_token, b.first_token = 0.0, 0.5
    loop.at(0.0, dec.add, a)
    loop.at(0.5, dec.add, b)
    loop.run()
    # a's step 0 runs [0, 1.001]; b joins at step 1 (context 1002 + 501)
    assert (b.join_step, b.join_time) == (1, pytest.approx(1.001))
    assert b.finished == pytest.approx(1.001 + 1.503)
    assert b.tbt_s == pytest.approx(1.001 + 1.503 - 0.5)  # wait for the boundary + the step
    # a: steps 1.001, 1.503, then alone again with context 1003
    assert a.finished == pytest.approx(1.001 + 1.503 + 1.003)
    assert a.tbt_s == pytest.approx(1.503)
    assert dec.tokens == 4


def test_full_batch_makes_requests_wait_for_a_slot():
    loop = EventLoop()
    dec = DecodeInstance("D", "n1", loop, TOY, lambda r: None, max_batch=1)
    a, b = req(0, 99, 3), req(1, 99, 2)
    for r in (a, b):
        r.first_token = 0.0
        loop.at(0.0, dec.add, r)
    loop.run()
    # a runs alone: 0.1 + 0.101; b joins then: its first gap includes the wait
    assert b.join_step == 2 and b.join_time == pytest.approx(0.201)
    assert b.tbt_s == pytest.approx(0.201 + 0.1)
    load = dec.load(loop.now())
    assert (load.batch_size, load.waiting, load.kv_tokens) == (0, 0, 0)


def test_decode_load_report_counts_context_grown_so_far():
    loop = EventLoop()
    dec = DecodeInstance("D", "n1", loop, TOY, lambda r: None)
    a = req(0, 1000, 10)
    a.first_token = 0.0
    loop.at(0.0, dec.add, a)
    loop.run(until=2.5)  # steps of 1.001 and 1.002 are done
    load = dec.load(2.5)
    assert (load.batch_size, load.kv_tokens) == (1, 1003)
    assert load.step_time_s == TOY.decode_step_time(1, 1003)


def test_chunked_prefill_sums_chunk_costs():
    cost = CostModel()
    whole = cost.prefill_time(10_000, 1_000)
    chunked = chunked_prefill_time(cost, 10_000, 1_000, 4096)
    assert chunked == pytest.approx(whole, rel=1e-12)
    assert chunked_prefill_time(cost, 100, 100, 64) == 0.0


def test_prefill_fifo_queue_and_load():
    loop = EventLoop()
    out = []
    link = Link(TOY)
    p = PrefillInstance(
        "P", "n0", loop, TOY, link, {"n0": link}, lambda r, t: out.append((r.rid, t))
    )
    a, b = req(0, 20, 1), req(1, 40, 1)
    loop.at(0.0, p.push, a)
    loop.at(0.0, p.push, b)
    loop.run(until=0.5)
    load = p.load(0.5)
    assert (load.queue_len, load.queued_tokens) == (2, 60)
    assert load.queued_work_s == pytest.approx(0.5 + 2.0)
    loop.run()
    assert out == [("r0", 1.0), ("r1", 3.0)]
    assert p.gpu_s == 3.0 and (a.started, b.started) == (0.0, 1.0)


def test_link_is_fifo():
    cost = CostModel()
    link = Link(cost)
    t1 = link.transfer(1000, 0.0)
    t2 = link.transfer(1000, 0.0)
    assert t1 == cost.transfer_time(1000)
    assert t2 == pytest.approx(2 * t1)
    assert link.bytes_moved == 2 * cost.kv_bytes(1000)


def test_top_mean_takes_the_longest_tenth():
    assert top_mean(list(range(1, 21)), 0.1) == 19.5  # 2 of 20
    assert top_mean([3.0, 1.0], 0.1) == 3.0
    assert top_mean([2.0], 0.1) == 2.0


def reference_decode(cost: CostModel, arrivals: list[tuple[float, int, int]], max_batch: int):
    """Per-step continuous batching (as the mock engine's loop): finish time and token gaps
    per request index."""
    pending = sorted(range(len(arrivals)), key=lambda i: (arrivals[i][0], i))
    waiting: list[int] = []
    running: dict[int, list] = {}  # i -> [context, generated, last token time, gaps]
    out: dict[int, tuple[float, list[float]]] = {}
    t = 0.0
    while pending or waiting or running:
        while pending and arrivals[pending[0]][0] <= t:
            i = pending.pop(0)
            if arrivals[i][2] <= 1:
                out[i] = (arrivals[i][0], [])
            else:
                waiting.append(i)
        while waiting and len(running) < max_batch:
            i = waiting.pop(0)
            running[i] = [arrivals[i][1] + 1, 1, arrivals[i][0], []]
        if not running:
            if pending:
                t = max(t, arrivals[pending[0]][0])
            continue
        t += cost.decode_step_time(len(running), sum(r[0] for r in running.values()))
        for i, r in list(running.items()):
            r[3].append(t - r[2])
            r[0], r[1], r[2] = r[0] + 1, r[1] + 1, t
            if r[1] >= arrivals[i][2]:
                out[i] = (t, r[3])
                del running[i]
    return out


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0, 3), st.integers(1, 2000), st.integers(1, 12)),
        min_size=1,
        max_size=12,
    ),
    st.integers(1, 4),
)
def test_segments_match_per_step_batching(arrivals, max_batch):
    loop = EventLoop()
    dec = DecodeInstance("D", "n1", loop, TOY, lambda r: None, max_batch=max_batch)
    reqs = []
    for i, (t, n, out) in enumerate(arrivals):
        r = req(i, n, out, t)
        r.first_token = t
        reqs.append(r)
        loop.at(t, dec.add, r)
    loop.run()
    ref = reference_decode(TOY, arrivals, max_batch)
    for i, r in enumerate(reqs):
        finish, gaps = ref[i]
        assert r.finished == pytest.approx(finish, rel=1e-9, abs=1e-9)
        expect = top_mean(gaps, 0.1) if gaps else -1.0
        assert r.tbt_s == pytest.approx(expect, rel=1e-9, abs=1e-9)
    assert dec.tokens == sum(max(0, out - 1) for _, _, out in arrivals)


def test_prefill_handoff_holds_the_instance_after_each_compute():
    loop = EventLoop()
    out, freed = [], []
    link = Link(TOY)
    p = PrefillInstance(
        "P",
        "n0",
        loop,
        TOY,
        link,
        {"n0": link},
        lambda r, t: out.append((r.rid, t)),
        handoff_s=0.25,
        on_free=lambda inst: freed.append(loop.now()),
    )
    a, b = req(0, 20, 1), req(1, 40, 1)
    loop.at(0.0, p.push, a)
    loop.at(0.0, p.push, b)
    loop.run(until=1.1)  # a computed at 1.0, handing over until 1.25
    load = p.load(1.1)
    assert (load.queue_len, load.queued_tokens, load.queued_work_s) == (2, 60, 2.0)
    loop.run()
    assert out == [("r0", 1.0), ("r1", 3.25)]
    assert (a.prefill_end, b.started, b.prefill_end) == (1.0, 1.25, 3.25)
    assert freed == [1.25, 3.5] and p.running is None
