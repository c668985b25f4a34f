"""DecodeWorker in-process on a real nats-server: DecodeTasks published directly."""

import asyncio
import time

import msgspec
import pytest

from bus_schemas import subjects
from bus_schemas.codec import decode, encode
from bus_schemas.control import Refused
from bus_schemas.load import DecodeLoad
from bus_schemas.placement import DecodeTask, RequestFailed
from bus_schemas.requests import (
    CancelAck,
    CancelRequest,
    Error,
    ErrorCode,
    Finished,
    Tokens,
    unbundled,
)
from tests.unit.conftest_fakestore import Rig, slot_kv, tokens_of, until_terminal, write_expected


def decode_task(rig: Rig, prompt, *, max_tokens=8, write_kv=True, **sampling) -> DecodeTask:
    """A DecodeTask whose prompt KV already sits in decode_tx's slots (prefill done)."""
    t = rig.task(prompt, max_tokens=max_tokens, **sampling)
    if write_kv:
        write_expected(
            slot_kv(rig.d, rig.layout, rig.res(t).decode_tx.slots, len(prompt)),
            prompt,
            0,
            len(prompt),
        )
    return DecodeTask(
        request=t.request,
        conductor_id=rig.cid,
        prefill_instance=rig.pi,
        prefill_node=rig.pn,
        prefill_tx_id=rig.res(t).prefill_tx.tx_id,
        decode_tx=rig.res(t).decode_tx,
        first_token=rig.reference(prompt, 1)[0],
        cached_tokens=5,
    )


async def send(rig: Rig, dt: DecodeTask) -> asyncio.Queue:
    q = await rig.listen(dt)
    await rig.tnc.publish(subjects.decode_tasks(rig.di), encode(dt))
    return q


async def cancel(rig: Rig, rid: str) -> None:
    await rig.tnc.publish(subjects.CANCEL, encode(CancelRequest(request_id=rid)))


@pytest.fixture
async def rig(nats_url):
    r = await Rig().start(nats_url)
    yield r
    await r.close()


@pytest.fixture
async def slow_rig(nats_url):
    r = await Rig(speedup=1.0).start(nats_url)  # ~9 ms per decode step
    yield r
    await r.close()


async def test_concurrent_requests_each_get_their_reference_tokens(rig):
    # Odd requests had their first token streamed by prefill: decode starts at index 1.
    prompts = [rig.prompt(20 + 13 * i, seed=i) for i in range(5)]
    dts = [
        msgspec.structs.replace(decode_task(rig, p, max_tokens=4 + i), first_token_sent=i % 2 == 1)
        for i, p in enumerate(prompts)
    ]
    queues = [await send(rig, dt) for dt in dts]
    for i, (p, q) in enumerate(zip(prompts, queues, strict=True)):
        events = await until_terminal(q)
        skip = i % 2
        assert tokens_of(events, start=skip) == rig.reference(p, 4 + i)[skip:]
        assert next(e for e in events if isinstance(e, Tokens)).index == skip
        assert events[-1] == Finished(
            request_id=dts[i].request.request_id,
            finish_reason="length",
            prompt_tokens=len(p),
            completion_tokens=4 + i,
            cached_tokens=5,
        )
    assert sorted(c.tx_id for c in rig.commits) == sorted(dt.decode_tx.tx_id for dt in dts)
    assert rig.conductor.empty()  # the prefill instance notifies the conductor, not decode


async def test_the_last_tokens_ride_on_finished_for_a_client_that_asks(rig):
    # A gateway asks (finish_with_tokens): the batch that ends the stream comes inside
    # Finished, one message fewer; a client that did not ask gets Tokens, then a bare
    # Finished. The answer fills no block here, so the write-back has nothing to wait on.
    for asked in (True, False):
        p = rig.prompt(33, seed=30 + asked)
        dt = decode_task(rig, p, max_tokens=5)
        dt = msgspec.structs.replace(
            dt, request=msgspec.structs.replace(dt.request, finish_with_tokens=asked)
        )
        events = await until_terminal(await send(rig, dt))
        end = events[-1]
        assert isinstance(end, Finished) and end.completion_tokens == 5
        assert (end.tokens is not None) == asked
        flat = [e for ev in events for e in unbundled(ev)]
        assert tokens_of(flat) == rig.reference(p, 5)
        assert isinstance(flat[-1], Finished) and flat[-1].tokens is None
        assert len(flat) == len(events) + asked


async def test_max_tokens_one_and_stop_token(rig):
    p = rig.prompt(40, seed=20)
    ref = rig.reference(p, 10)
    events = await until_terminal(await send(rig, decode_task(rig, p, max_tokens=1)))
    assert [type(e) for e in events] == [Tokens, Finished]
    assert events[0].token_ids == [ref[0]] and events[1].completion_tokens == 1
    k = next(i for i in range(1, 10) if ref[i] not in ref[:i])
    dt = decode_task(rig, p, max_tokens=10, stop_token_ids=[ref[k]])
    events = await until_terminal(await send(rig, dt))
    assert tokens_of(events) == ref[: k + 1]
    assert events[-1].finish_reason == "stop" and events[-1].completion_tokens == k + 1


async def test_cancel_mid_stream_finishes_with_abort(slow_rig):
    rig = slow_rig
    dt = decode_task(rig, rig.prompt(30, seed=21), max_tokens=100_000)
    q = await send(rig, dt)
    events = []
    while not (events and isinstance(events[-1], Tokens) and events[-1].index >= 1):
        events.append(await asyncio.wait_for(q.get(), 5))
    await cancel(rig, dt.request.request_id)
    events += await until_terminal(q)
    fin = events[-1]
    assert isinstance(fin, Finished) and fin.finish_reason == "abort"
    assert fin.completion_tokens == len(tokens_of(events)) >= 2
    c = await rig.stats("decode", rig.di)
    assert (c["tasks_aborted"], c["tasks_done"], c["tokens_generated"]) == (
        1,
        0,
        fin.completion_tokens,
    )
    assert rig.dengine.stats().batch_size == 0


async def test_load_report_shows_the_running_batch(slow_rig):
    rig = slow_rig
    loads: asyncio.Queue = asyncio.Queue()

    async def on_load(m):
        await loads.put(decode(m.data, DecodeLoad))

    await rig.tnc.subscribe(subjects.load_report("decode", rig.di), cb=on_load)
    dt = decode_task(rig, rig.prompt(30, seed=22), max_tokens=100_000)
    q = await send(rig, dt)
    await asyncio.wait_for(q.get(), 5)
    while (load := await asyncio.wait_for(loads.get(), 5)).batch_size != 1:
        pass
    assert (load.instance, load.node, load.max_batch) == (rig.di, rig.dn, 8)
    assert load.kv_tokens > 30 and load.step_time_s == rig.cost.decode_step_time(1, load.kv_tokens)
    await cancel(rig, dt.request.request_id)
    assert (await until_terminal(q))[-1].finish_reason == "abort"


async def test_kv_mismatch_fails_without_commit(rig):
    dt = decode_task(rig, rig.prompt(50, seed=23), write_kv=False)
    (err,) = await until_terminal(await send(rig, dt))
    assert isinstance(err, Error) and err.code == ErrorCode.INTERNAL
    assert err.message == "decode failed: kv mismatch: layer 0, token 0 of 50 loaded"
    ev = await asyncio.wait_for(rig.conductor.get(), 5)
    assert isinstance(ev, RequestFailed) and ev.prefill_tx_id == dt.prefill_tx_id
    assert rig.commits == []
    assert (await rig.stats("decode", rig.di))["tasks_failed"] == 1


async def test_refused_commit_does_not_fail_the_request(nats_url):
    # The KV is in the engine before the commit: a store that rolled the tx back only
    # loses the cache entry, so the client still gets its whole answer.
    rig = await Rig(commit_reply=Refused(reason="unknown_tx", message="lease expired")).start(
        nats_url
    )
    try:
        p = rig.prompt(33, seed=24)
        dt = decode_task(rig, p, max_tokens=5)
        events = await until_terminal(await send(rig, dt))
        assert tokens_of(events) == rig.reference(p, 5)
        assert isinstance(events[-1], Finished) and events[-1].finish_reason == "length"
        stats = await rig.stats("decode", rig.di)
        assert stats["commits_failed"] == 1 and stats["tasks_done"] == 1
    finally:
        await rig.close()


async def test_cancel_before_the_task_arrives_drops_it(rig):
    dt = decode_task(rig, rig.prompt(20, seed=25))
    await cancel(rig, dt.request.request_id)
    (err,) = await until_terminal(await send(rig, dt))
    assert err.code == ErrorCode.CANCELLED
    assert isinstance(await asyncio.wait_for(rig.conductor.get(), 5), RequestFailed)


async def test_shutdown_fails_running_requests_with_503(nats_url):
    rig = await Rig(speedup=1.0).start(nats_url)
    dt = decode_task(rig, rig.prompt(30, seed=26), max_tokens=100_000)
    q = await send(rig, dt)
    first = await asyncio.wait_for(q.get(), 5)
    assert isinstance(first, Tokens)
    await rig.decode.close()
    events = await until_terminal(q)
    assert isinstance(events[-1], Error) and events[-1].code == ErrorCode.UNAVAILABLE
    assert events[-1].message == "decode instance shutting down"
    await rig.close()


async def test_kv_the_store_no_longer_holds_is_not_loaded(rig):
    # The store answers the renewal that it lost the decode tx (a restart) and the
    # handle's lease ends inside the worker's margin: loading the slots now could read
    # blocks handed to another request, so the request fails.
    rig.renew_known = False
    dt = decode_task(rig, rig.prompt(30, seed=27))
    soon = msgspec.structs.replace(dt.decode_tx, expires_at=time.time() + 1.0)
    (err,) = await until_terminal(await send(rig, msgspec.structs.replace(dt, decode_tx=soon)))
    assert err.code == ErrorCode.UNAVAILABLE
    assert err.message == "the store no longer holds the request's KV for the decode engine"
    assert isinstance(await asyncio.wait_for(rig.conductor.get(), 5), RequestFailed)
    assert rig.commits == [] and rig.dengine.stats().batch_size == 0


async def test_a_renewed_lease_keeps_the_kv_however_old_the_handle(rig):
    # The same handle, but the store renews: the request is served.
    dt = decode_task(rig, rig.prompt(30, seed=28))
    soon = msgspec.structs.replace(dt.decode_tx, expires_at=time.time() + 1.0)
    events = await until_terminal(await send(rig, msgspec.structs.replace(dt, decode_tx=soon)))
    assert isinstance(events[-1], Finished) and events[-1].finish_reason == "length"
    assert [r.tx_ids for r in rig.renewals] == [[dt.decode_tx.tx_id]]


async def test_a_fresh_handle_is_loaded_without_asking_the_store_first(rig):
    # Its end lies beyond the keeper's next renewal: a renewal now would tell nothing
    # new, and cost the request a round trip before its first token.
    dt = decode_task(rig, rig.prompt(30, seed=29))
    fresh = msgspec.structs.replace(dt.decode_tx, expires_at=time.time() + 60.0)
    events = await until_terminal(await send(rig, msgspec.structs.replace(dt, decode_tx=fresh)))
    assert isinstance(events[-1], Finished) and events[-1].finish_reason == "length"
    assert rig.renewals == []
    # One that names no end is renewed first, as any whose end is near.
    dt = decode_task(rig, rig.prompt(30, seed=30))
    unknown = msgspec.structs.replace(dt.decode_tx, expires_at=0.0)
    events = await until_terminal(await send(rig, msgspec.structs.replace(dt, decode_tx=unknown)))
    assert isinstance(events[-1], Finished)
    assert [r.tx_ids for r in rig.renewals] == [[dt.decode_tx.tx_id]]


# ---------------------------------------------------------------- incarnations


async def test_a_task_for_another_incarnation_is_refused_as_a_restart(rig):
    dt = decode_task(rig, rig.prompt(20, seed=31))
    dt = msgspec.structs.replace(dt, decode_incarnation=rig.decode.incarnation - 1)
    (err,) = await until_terminal(await send(rig, dt))
    assert err.code == ErrorCode.UNAVAILABLE and err.message.startswith("instance restarted")
    assert isinstance(await asyncio.wait_for(rig.conductor.get(), 5), RequestFailed)
    assert (await rig.stats("decode", rig.di))["tasks_refused_incarnation"] == 1


async def test_a_task_for_this_incarnation_is_served(rig):
    prompt = rig.prompt(20, seed=32)
    dt = decode_task(rig, prompt, max_tokens=4)
    dt = msgspec.structs.replace(dt, decode_incarnation=rig.decode.incarnation)
    events = await until_terminal(await send(rig, dt))
    assert isinstance(events[-1], Finished)
    assert tokens_of(events) == rig.reference(prompt, 4)
    assert all(e.incarnation == rig.decode.incarnation for e in events if isinstance(e, Tokens))


async def ask_cancel(rig: Rig, rid: str, incarnation: int) -> CancelAck:
    c = CancelRequest(request_id=rid, targets={rig.di: incarnation})
    msg = await rig.tnc.request(subjects.CANCEL, encode(c), timeout=5)
    return decode(msg.data, CancelAck)


async def test_a_cancel_naming_this_incarnation_is_acknowledged_and_acted_on(slow_rig):
    rig = slow_rig
    dt = decode_task(rig, rig.prompt(30, seed=33), max_tokens=100_000)
    q = await send(rig, dt)
    while not isinstance(ev := await asyncio.wait_for(q.get(), 5), Tokens) or ev.index < 1:
        pass
    ack = await ask_cancel(rig, dt.request.request_id, rig.decode.incarnation)
    assert (ack.instance, ack.incarnation, ack.held, ack.refused) == (
        rig.di,
        rig.decode.incarnation,
        True,
        False,
    )
    fin = (await until_terminal(q))[-1]
    assert isinstance(fin, Finished) and fin.finish_reason == "abort"


async def test_a_cancel_naming_another_incarnation_is_refused_and_ignored(slow_rig):
    rig = slow_rig
    prompt = rig.prompt(30, seed=34)
    dt = decode_task(rig, prompt, max_tokens=6)
    q = await send(rig, dt)
    while not isinstance(ev := await asyncio.wait_for(q.get(), 5), Tokens):
        pass
    ack = await ask_cancel(rig, dt.request.request_id, rig.decode.incarnation - 1)
    assert ack.refused and not ack.held
    events = [ev, *await until_terminal(q)]
    fin = events[-1]
    assert isinstance(fin, Finished) and fin.finish_reason == "length"  # ran to its end


async def test_n_sequences_share_the_shipped_kv_and_end_in_one_finished(rig):
    # n = 3: sequence 0 continues prefill's first token; 1 and 2 are engine requests on
    # the same decode_tx slots, each sampling its own first token (index 0 of its seq).
    p = rig.prompt(45, seed=30)
    dt = decode_task(rig, p, max_tokens=6, n=3, seed=11)
    before = await rig.stats("decode", rig.di)
    events = await until_terminal(await send(rig, dt))
    seqs: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for e in events:
        if isinstance(e, Tokens):
            assert e.index == len(seqs[e.seq])  # each sequence's indices run from 0
            seqs[e.seq] += e.token_ids
    assert seqs[0] == rig.reference(p, 6)  # as for n = 1
    assert all(len(s) == 6 for s in seqs.values())
    assert len({tuple(s) for s in seqs.values()}) == 3  # three different answers
    fin = events[-1]
    assert isinstance(fin, Finished)
    assert fin.completion_tokens == 18
    assert fin.seq_finish == ["length"] * 3 and fin.seq_tokens == [6, 6, 6]
    after = await rig.stats("decode", rig.di)
    assert after["sequences_sharing_kv"] - before.get("sequences_sharing_kv", 0) == 2
    assert after["kv_tokens_loaded"] - before["kv_tokens_loaded"] == len(p)  # one task's KV
    assert [c.tx_id for c in rig.commits] == [dt.decode_tx.tx_id]  # one transaction
    assert rig.dengine.stats().batch_size == 0


def record_adds(rig: Rig, monkeypatch) -> list[tuple]:
    """(event, seq, prefix group) of each engine.add_request: when called, when back."""
    calls: list[tuple] = []
    real = rig.dengine.add_request

    async def add(job):
        calls.append(("add", job.seq, job.prefix_group))
        stream = await real(job)
        calls.append(("back", job.seq, stream.done))
        return stream

    monkeypatch.setattr(rig.dengine, "add_request", add)
    return calls


async def test_sequence_0_is_in_the_engine_before_the_others_share_its_prompt(rig, monkeypatch):
    # The others are added once the engine has sequence 0's KV (its add returned), in
    # its group: an engine with a prefix cache then finds the prompt's pages there.
    calls = record_adds(rig, monkeypatch)
    dt = decode_task(rig, rig.prompt(45, seed=35), max_tokens=6, n=3, seed=3)
    fin = (await until_terminal(await send(rig, dt)))[-1]
    assert isinstance(fin, Finished) and fin.seq_tokens == [6, 6, 6]
    rid = dt.request.request_id
    assert calls[:2] == [("add", 0, None), ("back", 0, False)]
    assert sorted(c for c in calls[2:] if c[0] == "add") == [("add", 1, rid), ("add", 2, rid)]


async def test_a_sequence_0_over_at_its_first_token_hands_the_lead_on(rig, monkeypatch):
    # max_tokens 1: prefill's first token ends sequence 0 before it reaches the engine,
    # so sequence 1 loads the prompt and sequence 2 joins it afterwards.
    calls = record_adds(rig, monkeypatch)
    dt = decode_task(rig, rig.prompt(45, seed=36), max_tokens=1, n=3, seed=3)
    fin = (await until_terminal(await send(rig, dt)))[-1]
    assert isinstance(fin, Finished) and fin.seq_tokens == [1, 1, 1]
    rid = dt.request.request_id
    assert calls[:3] == [("add", 0, None), ("back", 0, True), ("add", 1, rid)]
    assert calls.index(("add", 2, rid)) > next(
        i for i, c in enumerate(calls) if c[:2] == ("back", 1)
    )


async def test_cancel_stops_every_sequence(slow_rig):
    rig = slow_rig
    dt = decode_task(rig, rig.prompt(30, seed=31), max_tokens=100_000, n=2)
    q = await send(rig, dt)
    events = []
    while not (events and isinstance(events[-1], Tokens) and events[-1].index >= 2):
        events.append(await asyncio.wait_for(q.get(), 5))
    await cancel(rig, dt.request.request_id)
    events += await until_terminal(q)
    fin = events[-1]
    assert isinstance(fin, Finished) and fin.seq_finish == ["abort", "abort"]
    assert rig.dengine.stats().batch_size == 0
