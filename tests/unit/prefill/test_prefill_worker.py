"""PrefillWorker and DecodeWorker in-process on a real nats-server, with fake stores."""

import asyncio
import dataclasses

import msgspec
import pytest

from bus_schemas import subjects
from bus_schemas.codec import decode, encode
from bus_schemas.load import PrefillLoad
from bus_schemas.placement import FirstTokenNotice, RequestFailed
from bus_schemas.requests import CancelRequest, Error, ErrorCode, Finished, Tokens
from services.common.clock import ManualClock
from tests.unit.conftest_fakestore import (
    Rig,
    assert_expected,
    shipped_layers,
    slot_kv,
    tokens_of,
    until_terminal,
)


@pytest.fixture
async def rig(nats_url):
    r = await Rig().start(nats_url)
    yield r
    await r.close()


async def test_prefill_with_local_prefix_hands_off_and_decode_streams(rig):
    prompt = rig.prompt(100, seed=1)  # 3 full blocks + a 4-token tail
    t = rig.task(prompt, p_hit=1, d_hit=1, max_tokens=7)
    events = await until_terminal(await rig.submit(t))

    dt = await asyncio.wait_for(rig.decode_tasks.get(), 5)
    ref = rig.reference(prompt, 7)
    assert dt.request == t.request and dt.decode_tx == rig.res(t).decode_tx
    assert (dt.conductor_id, dt.prefill_instance, dt.prefill_node) == (rig.cid, rig.pi, rig.pn)
    assert dt.prefill_tx_id == rig.res(t).prefill_tx.tx_id
    assert dt.first_token == ref[0] and dt.cached_tokens == 32 and dt.prefill_done_ts > 0

    # every layer shipped, blocks the decode node already had skipped, under one grant
    # that the first ship opened (no compute to overlap a head start with)
    assert rig.p.leases == []
    assert shipped_layers(rig.p, rig.layout.layer_bytes) == [
        (layer, (1, 2, 3)) for layer in range(rig.spec.num_layers)
    ]
    assert_expected(slot_kv(rig.d, rig.layout, rig.res(t).decode_tx.slots, 100), prompt)
    assert_expected(slot_kv(rig.p, rig.layout, rig.res(t).prefill_tx.slots, 100), prompt)

    # the first token came straight from prefill, the rest from decode
    assert isinstance(events[0], Tokens) and events[0].token_ids == [ref[0]]
    assert events[0].from_prefill and events[0].index == 0 and dt.first_token_sent
    assert not any(e.from_prefill for e in events[1:] if isinstance(e, Tokens))
    assert tokens_of(events) == ref
    assert events[-1] == Finished(
        request_id=t.request.request_id,
        finish_reason="length",
        prompt_tokens=100,
        completion_tokens=7,
        cached_tokens=32,
    )
    assert [(c.tx_id, c.request_id) for c in rig.commits] == [
        (rig.res(t).decode_tx.tx_id, t.request.request_id)
    ]
    ev = await asyncio.wait_for(rig.conductor.get(), 5)
    assert isinstance(ev, FirstTokenNotice)
    assert (ev.request_id, ev.prefill_node, ev.prefill_tx_id) == (
        t.request.request_id,
        rig.pn,
        rig.res(t).prefill_tx.tx_id,
    )
    # The last ship had the prefill node's store commit the prefill tx: the conductor
    # is told it need not.
    assert rig.p.shipped_commits == [(rig.res(t).prefill_tx.tx_id, t.request.request_id)]
    assert ev.prefill_committed
    assert rig.reserver.committed == [rig.res(t).prefill_tx.tx_id]  # its lease dropped

    pc = await rig.stats("prefill", rig.pi)
    assert pc == {
        "tasks_done": 1,
        "tasks_failed": 0,
        "tasks_cancelled": 0,
        "computed_tokens": 68,
        "prefix_tokens_loaded": 32,
        "remote_tokens_pulled": 0,
        # the rig's tasks are the worker's own to reserve (no conductor sent them ahead)
        "ahead_taken": 0,
        "ahead_missing": 0,
        "ahead_aborted": 0,
    }
    dc = await rig.stats("decode", rig.di)
    wb = {k: dc.pop(k) for k in [k for k in dc if k.startswith("writeback_")]}
    assert wb and not any(wb.values())  # 7 tokens fill no block of the answer: none written
    assert dc == {
        "tasks_done": 1,
        "tasks_failed": 0,
        "tasks_aborted": 0,
        "tokens_generated": 7,
        "kv_tokens_loaded": 100,
        "commits_failed": 0,
        "sequences_sharing_kv": 0,  # n = 1
        "running": 0,
    }


async def test_the_first_token_goes_out_before_the_last_layer_ships(rig, monkeypatch):
    # The last layer's ship is a write to the store that would delay the client's
    # first token; decode waits for every layer anyway.
    from services.prefill import worker as worker_mod

    order: list[object] = []
    publish, ship = worker_mod.bus.publish, rig.p.ship_layer

    async def spy_publish(nc, subject, msg, *a, **kw):
        if isinstance(msg, Tokens):
            order.append("first token")
        return await publish(nc, subject, msg, *a, **kw)

    async def spy_ship(src, dst, layer, blocks, layer_bytes, layer_offset, **kw):
        last = (layer_offset + layer_bytes) // rig.layout.layer_bytes - 1
        order.append(("ship", layer, last))
        return await ship(src, dst, layer, blocks, layer_bytes, layer_offset, **kw)

    computing = rig.reserver.computing

    async def late_computing(r, work):
        # As LeaseKeeper.before_expiry does, the compute runs in a task of its own, and
        # the worker resumes some loop turns after it ends.
        out = await computing(r, asyncio.ensure_future(work))
        for _ in range(3):
            await asyncio.sleep(0)
        return out

    monkeypatch.setattr(worker_mod.bus, "publish", spy_publish)
    monkeypatch.setattr(rig.p, "ship_layer", spy_ship)
    monkeypatch.setattr(rig.reserver, "computing", late_computing)
    prompt = rig.prompt(70, seed=3)
    t = rig.task(prompt, max_tokens=2)
    events = await until_terminal(await rig.submit(t))
    assert tokens_of(events) == rig.reference(prompt, 2)
    top = rig.spec.num_layers - 1
    with_last = [i for i, o in enumerate(order) if isinstance(o, tuple) and o[2] == top]
    assert len(with_last) == 1 and order.index("first token") < with_last[0]
    assert_expected(slot_kv(rig.d, rig.layout, rig.res(t).decode_tx.slots, 70), prompt)


async def test_first_token_waits_for_decode_when_prefill_may_not_stream_it(rig):
    # The baseline admission may still reject at decode: decode emits the first token.
    prompt = rig.prompt(50, seed=7)
    t = msgspec.structs.replace(rig.task(prompt, max_tokens=3), stream_first_token=False)
    events = await until_terminal(await rig.submit(t))
    dt = await asyncio.wait_for(rig.decode_tasks.get(), 5)
    assert not dt.first_token_sent
    toks = [e for e in events if isinstance(e, Tokens)]
    assert toks[0].index == 0 and not any(e.from_prefill for e in toks)
    assert tokens_of(events) == rig.reference(prompt, 3)
    assert isinstance(await asyncio.wait_for(rig.conductor.get(), 5), FirstTokenNotice)


async def test_remote_prefix_is_pulled_before_compute(rig):
    prompt = rig.prompt(80, seed=2)
    t = rig.task(prompt, p_hit=0, remote_blocks=2, max_tokens=3)
    events = await until_terminal(await rig.submit(t))
    assert tokens_of(events) == rig.reference(prompt, 3)
    assert events[-1].cached_tokens == 64
    assert rig.p.pulls == [rig.res(t).remote]
    assert shipped_layers(rig.p, rig.layout.layer_bytes) == [
        (layer, (0, 1, 2)) for layer in range(rig.spec.num_layers)
    ]
    pc = await rig.stats("prefill", rig.pi)
    assert (pc["remote_tokens_pulled"], pc["prefix_tokens_loaded"], pc["computed_tokens"]) == (
        64,
        64,
        16,
    )


async def test_full_hit_on_both_nodes_ships_nothing(rig):
    prompt = rig.prompt(64, seed=3)
    t = rig.task(prompt, p_hit=2, d_hit=2, max_tokens=2)
    events = await until_terminal(await rig.submit(t))
    assert tokens_of(events) == rig.reference(prompt, 2)
    assert rig.p.ships == [] and rig.p.leases == []
    # No ship, so no commit with one: the conductor commits the prefill tx.
    ev = await asyncio.wait_for(rig.conductor.get(), 5)
    assert isinstance(ev, FirstTokenNotice) and not ev.prefill_committed
    assert rig.p.shipped_commits == []


async def test_corrupt_prefix_fails_the_request_with_kv_mismatch(rig):
    prompt = rig.prompt(70, seed=4)
    t = rig.task(prompt, p_hit=2, write_prefix=False)
    (err,) = await until_terminal(await rig.submit(t))
    assert isinstance(err, Error) and err.code == ErrorCode.INTERNAL
    assert "kv mismatch: layer 0, token 0" in err.message
    ev = await asyncio.wait_for(rig.conductor.get(), 5)
    assert isinstance(ev, RequestFailed) and ev.prefill_tx_id == rig.res(t).prefill_tx.tx_id
    assert ev.request_id == t.request.request_id and ev.prefill_node == rig.pn
    assert rig.decode_tasks.empty()
    assert (await rig.stats("prefill", rig.pi))["tasks_failed"] == 1


async def test_a_compute_longer_than_a_round_trip_opens_the_grant_as_it_starts(nats_url):
    rig = await Rig(speedup=1.0).start(nats_url)  # the cost model's time: ms a layer
    try:
        prompt = rig.prompt(100, seed=1)
        t = rig.task(prompt, p_hit=1, d_hit=1, max_tokens=3)
        events = await until_terminal(await rig.submit(t))
        assert isinstance(events[-1], Finished)
        assert rig.p.leases == [(rig.res(t).decode_tx.tx_id, (1, 2, 3))]
        assert shipped_layers(rig.p, rig.layout.layer_bytes) == [
            (layer, (1, 2, 3)) for layer in range(rig.spec.num_layers)
        ]
    finally:
        await rig.close()


async def test_dead_decode_store_is_a_503(nats_url):
    # Paced (the cost model's time, ~ms a layer): the first layer's failed ship stops
    # the compute before its first token goes out. An unpaced mock runs every layer
    # before a ship's reply could come, as one forward pass of a real engine does.
    rig = await Rig(speedup=1.0).start(nats_url)
    try:
        prompt = rig.prompt(40, seed=5)
        t = rig.task(prompt)
        del rig.net[rig.dn]  # the decode node's store is gone
        (err,) = await until_terminal(await rig.submit(t))
        assert err.code == ErrorCode.UNAVAILABLE and err.message.startswith("kv transfer failed")
        assert isinstance(await asyncio.wait_for(rig.conductor.get(), 5), RequestFailed)
    finally:
        await rig.close()


async def test_dead_decode_store_after_an_unpaced_first_token_is_a_503(rig):
    # Every layer ran before the ship failed: the first token is out, then the error.
    prompt = rig.prompt(40, seed=5)
    t = rig.task(prompt)
    del rig.net[rig.dn]
    events = await until_terminal(await rig.submit(t))
    err = events[-1]
    assert err.code == ErrorCode.UNAVAILABLE and err.message.startswith("kv transfer failed")
    assert [type(e) for e in events[:-1]] == [Tokens]
    assert isinstance(await asyncio.wait_for(rig.conductor.get(), 5), RequestFailed)


async def test_bad_task_is_refused_before_queueing(rig):
    t = rig.task(rig.prompt(40, seed=6))
    bad = msgspec.structs.replace(t, prefill_node="elsewhere")
    (err,) = await until_terminal(await rig.submit(bad))
    assert err.code == ErrorCode.INTERNAL and err.message == (
        f"bad prefill task: placed for node elsewhere, this instance is on {rig.pn}"
    )
    assert rig.reserver.reserved == []  # nothing was reserved for it


async def test_reservation_that_does_not_fit_is_released(rig):
    t = rig.task(rig.prompt(40, seed=6))
    rid = t.request.request_id
    res = rig.res(t)
    rig.reserver.planned[rid] = dataclasses.replace(
        res, prefill_tx=msgspec.structs.replace(res.prefill_tx, slots=[0])
    )
    (err,) = await until_terminal(await rig.submit(t))
    assert err.code == ErrorCode.INTERNAL and err.message == (
        "bad prefill task: prefill tx has 1 slots for 40 tokens"
    )
    assert rig.reserver.released == [(rid, err.message)] and rig.reserver.handed_off == []


async def test_a_lease_lost_before_the_compute_writes_nothing_and_is_a_503(rig):
    # The engine would write the prompt's KV into the prefill tx's slots after the
    # store may have handed them on: the compute never runs, the request fails.
    t = rig.task(rig.prompt(40, seed=7))
    rid = t.request.request_id
    rig.reserver.lose.add(rig.res(t).prefill_tx.tx_id)
    (err,) = await until_terminal(await rig.submit(t))
    assert err.code == ErrorCode.UNAVAILABLE and "no longer holds the slots" in err.message
    assert rig.reserver.released == [(rid, err.message)] and rig.reserver.handed_off == []
    assert (await rig.stats("prefill", rig.pi))["computed_tokens"] == 0
    assert rig.decode_tasks.empty()


async def test_queued_requests_hold_no_reservation_until_their_compute_starts(nats_url):
    gate = Gate()
    rig = await Rig(speedup=1e6, prefill_sleep=gate).start(nats_url)
    try:
        a = rig.task(rig.prompt(50, seed=40), max_tokens=2)
        b = rig.task(rig.prompt(60, seed=41), max_tokens=2)
        qa, qb = await rig.submit(a), await rig.submit(b)
        await asyncio.wait_for(gate.entered.get(), 5)  # a computes, b waits in the queue
        while len(rig.prefill.queue) < 2:  # b's task is still on the bus
            await asyncio.sleep(0.01)
        assert rig.reserver.reserved == [a.request.request_id]
        gate.open.set()
        await until_terminal(qa)
        await until_terminal(qb)
        assert rig.reserver.reserved == [a.request.request_id, b.request.request_id]
        assert rig.reserver.handed_off == rig.reserver.reserved
    finally:
        await rig.close()


class Gate:
    """A prefill sleep that blocks until the test opens it."""

    def __init__(self) -> None:
        self.entered = asyncio.Queue()
        self.open = asyncio.Event()

    async def __call__(self, seconds: float) -> None:
        await self.entered.put(seconds)
        await self.open.wait()


async def test_the_first_token_says_how_much_of_its_wait_the_engine_accounts_for(
    nats_url, monkeypatch
):
    # The gateway's overhead gate (services.gateway.lateness) subtracts it: the engine's
    # compute, the requests' ahead of it too, but no reservation's wait (its own, or
    # one ahead of it in the queue).
    clock, gate = ManualClock(100.0), Gate()
    rig = await Rig(speedup=1e6, prefill_sleep=gate, clock=clock).start(nats_url)
    try:
        reserve, reserving, hold = rig.reserver.reserve, asyncio.Event(), asyncio.Event()
        a = rig.task(rig.prompt(50, seed=42), max_tokens=2)
        b = rig.task(rig.prompt(60, seed=43), max_tokens=2)

        async def slow_reserve(task, ahead=None):
            if task.request.request_id == a.request.request_id:
                reserving.set()
                await hold.wait()
            clock.advance(5.0)  # the stores' answers: the control plane's part
            return await reserve(task, ahead=ahead)

        monkeypatch.setattr(rig.reserver, "reserve", slow_reserve)
        qa = await rig.submit(a)
        await asyncio.wait_for(reserving.wait(), 5)
        qb = await rig.submit(b)
        while len(rig.prefill.queue) < 2:  # b's task is still on the bus
            await asyncio.sleep(0.01)
        hold.set()  # a reserves (100 -> 105) while b waits
        await asyncio.wait_for(gate.entered.get(), 5)  # a computes
        clock.advance(2.0)
        gate.open.set()  # b then reserves (107 -> 112) and computes in no time
        firsts = []
        for q in (qa, qb):
            events = await until_terminal(q)
            firsts += [e for e in events if isinstance(e, Tokens) and e.from_prefill]
        assert [(t.index, t.engine_s) for t in firsts] == [(0, 2.0), (0, 2.0)]
    finally:
        await rig.close()


async def test_queue_is_fifo_reports_load_and_honours_cancel(nats_url):
    gate = Gate()
    rig = await Rig(speedup=1e6, prefill_sleep=gate).start(nats_url)
    try:
        loads: asyncio.Queue = asyncio.Queue()

        async def on_load(m):
            await loads.put(decode(m.data, PrefillLoad))

        await rig.tnc.subscribe(subjects.load_report("prefill", rig.pi), cb=on_load)
        a = rig.task(rig.prompt(50, seed=7), max_tokens=2)
        b = rig.task(rig.prompt(60, seed=8), max_tokens=2)
        c = rig.task(rig.prompt(70, seed=9), max_tokens=2)
        qa, qb, qc = await rig.submit(a), await rig.submit(b), await rig.submit(c)
        await asyncio.wait_for(gate.entered.get(), 5)  # a is computing, b and c wait
        while True:
            load = await asyncio.wait_for(loads.get(), 5)
            if load.queue_len == 3:
                break
        assert load.queued_tokens == 180 and load.node == rig.pn
        want = rig.cost.prefill_time(60) + rig.cost.prefill_time(70)
        assert want <= load.queued_work_s <= want + rig.cost.prefill_time(50)

        await rig.tnc.publish(
            subjects.CANCEL, encode(CancelRequest(request_id=b.request.request_id))
        )
        (err,) = await until_terminal(qb)
        assert err.code == ErrorCode.CANCELLED
        await rig.tnc.publish(
            subjects.CANCEL, encode(CancelRequest(request_id=a.request.request_id))
        )
        (err,) = await until_terminal(qa)
        assert err.code == ErrorCode.CANCELLED
        failed = {(await asyncio.wait_for(rig.conductor.get(), 5)).request_id for _ in range(2)}
        assert failed == {a.request.request_id, b.request.request_id}

        gate.open.set()
        events = await until_terminal(qc)
        assert tokens_of(events) == rig.reference(c.request.prompt_token_ids, 2)
        pc = await rig.stats("prefill", rig.pi)
        assert (pc["tasks_done"], pc["tasks_cancelled"], pc["computed_tokens"]) == (1, 2, 70)
        # a task for a request cancelled before it arrived is dropped at once
        await rig.tnc.publish(subjects.CANCEL, encode(CancelRequest(request_id="late")))
        late = rig.task(rig.prompt(10), rid="late")
        (err,) = await until_terminal(await rig.submit(late))
        assert err.code == ErrorCode.CANCELLED
    finally:
        await rig.close()


async def test_shutdown_fails_queued_and_running_tasks(nats_url):
    gate = Gate()
    rig = await Rig(speedup=1e6, prefill_sleep=gate).start(nats_url)
    loads: asyncio.Queue = asyncio.Queue()

    async def on_load(m):
        await loads.put(decode(m.data, PrefillLoad))

    await rig.tnc.subscribe(subjects.load_report("prefill", rig.pi), cb=on_load)
    a = rig.task(rig.prompt(50, seed=10))
    b = rig.task(rig.prompt(60, seed=11))
    qa, qb = await rig.submit(a), await rig.submit(b)
    await asyncio.wait_for(gate.entered.get(), 5)
    while (await asyncio.wait_for(loads.get(), 5)).queue_len != 2:
        pass  # b is queued too
    await rig.prefill.close()
    for q in (qa, qb):
        (err,) = await until_terminal(q)
        assert err.code == ErrorCode.UNAVAILABLE and "shutting down" in err.message
    await rig.close()


async def test_next_request_computes_while_the_previous_kv_is_shipping(rig):
    # The link is stalled: request a's KV cannot leave, yet b is computed and streams
    # its first token; a is handed to decode only once its ships are through.
    rig.p.gate = asyncio.Event()
    pa, pb = rig.prompt(40, seed=8), rig.prompt(45, seed=9)
    ta, tb = rig.task(pa, max_tokens=2), rig.task(pb, max_tokens=2)
    qa, qb = await rig.submit(ta), await rig.submit(tb)
    first_a, first_b = await asyncio.wait_for(qa.get(), 5), await asyncio.wait_for(qb.get(), 5)
    assert (first_a.from_prefill, first_a.token_ids) == (True, rig.reference(pa, 1))
    assert (first_b.from_prefill, first_b.token_ids) == (True, rig.reference(pb, 1))
    assert rig.decode_tasks.empty() and rig.p.ships == []
    assert (await rig.stats("prefill", rig.pi))["tasks_done"] == 0
    rig.p.gate.set()
    assert tokens_of([first_a, *await until_terminal(qa)]) == rig.reference(pa, 2)
    assert tokens_of([first_b, *await until_terminal(qb)]) == rig.reference(pb, 2)
    handed = {
        (await asyncio.wait_for(rig.decode_tasks.get(), 5)).request.request_id for _ in range(2)
    }
    assert handed == {ta.request.request_id, tb.request.request_id}
    assert (await rig.stats("prefill", rig.pi))["tasks_done"] == 2


async def test_cancel_while_shipping_stops_the_handoff(rig):
    rig.p.gate = asyncio.Event()
    t = rig.task(rig.prompt(40, seed=10), max_tokens=2)
    q = await rig.submit(t)
    first = await asyncio.wait_for(q.get(), 5)
    assert first.from_prefill
    await rig.tnc.publish(subjects.CANCEL, encode(CancelRequest(request_id=t.request.request_id)))
    (err,) = await until_terminal(q)
    assert err.code == ErrorCode.CANCELLED
    ev = await asyncio.wait_for(rig.conductor.get(), 5)
    assert isinstance(ev, RequestFailed) and ev.prefill_tx_id == rig.res(t).prefill_tx.tx_id
    rig.p.gate.set()
    await rig.p.gate_drained()  # a ship the cancel left running would land by now
    assert rig.decode_tasks.empty() and rig.p.ships == []
    assert (await rig.stats("prefill", rig.pi))["tasks_cancelled"] == 1


async def test_shutdown_fails_a_request_whose_kv_is_still_shipping(rig):
    rig.p.gate = asyncio.Event()  # never opened: the handoff cannot finish
    t = rig.task(rig.prompt(40, seed=11), max_tokens=2)
    q = await rig.submit(t)
    assert (await asyncio.wait_for(q.get(), 5)).from_prefill
    await rig.prefill.close()
    (err,) = await until_terminal(q)
    assert (err.code, err.message) == (ErrorCode.UNAVAILABLE, "prefill instance shutting down")
    ev = await asyncio.wait_for(rig.conductor.get(), 5)
    assert isinstance(ev, RequestFailed) and ev.prefill_tx_id == rig.res(t).prefill_tx.tx_id
    assert rig.decode_tasks.empty()
