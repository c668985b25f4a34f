"""Crash-safe intake on a real nats-server (JetStream): the placement claim, a
conductor that re-sends a claimed placement instead of placing again, admission that
forwards a redelivered request without deciding again, and a prefill worker that runs a
task sent twice once."""

import asyncio
import time
import uuid

import nats
import pytest
from nats.js import api

from bus_schemas import subjects
from bus_schemas.codec import decode, encode
from bus_schemas.placement import PrefillTask
from bus_schemas.requests import Accepted, Error, ErrorCode, GenerateRequest
from services.common import bus, intake_queue
from tests.unit.admission.test_admission_service import Harness as AdmissionHarness
from tests.unit.conductor.test_conductor_service import HASHES, PROMPT, FakeStore
from tests.unit.conductor.test_conductor_service import Harness as ConductorHarness
from tests.unit.conftest_fakestore import Rig, tokens_of, until_terminal


def rid() -> str:
    return f"iq-{uuid.uuid4().hex[:10]}"


async def test_the_first_claim_of_a_request_id_holds_and_a_later_one_gets_it_back(nats_url):
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        await intake_queue.ensure_streams(js, [intake_queue.PLACED_STREAM])
        a, b = rid(), rid()
        assert await intake_queue.claimed(js, a) is None
        assert await intake_queue.claim(js, a, b"first") == (b"first", True)
        assert await intake_queue.claim(js, a, b"second") == (b"first", False)
        assert await intake_queue.claimed(js, a) == b"first"
        # Ids that are not subject tokens (dots, spaces, wildcards) claim apart.
        assert await intake_queue.claim(js, b + ". *>", b"other") == (b"other", True)
        assert await intake_queue.claimed(js, b) is None
    finally:
        await nc.close()


@pytest.fixture
async def conductor(nats_url):
    h = ConductorHarness(nats_url)
    await h.start(
        [FakeStore(None, "np0"), FakeStore(None, "np1", held=HASHES[:2]), FakeStore(None, "nd0")],
        prefills=[("prefill-0", "np0", 0.0), ("prefill-1", "np1", 0.0)],
        decodes=[("decode-0", "nd0")],
        durable_intake=True,
    )
    yield h
    await h.close()


async def queue_drained(h) -> None:
    """Everything published on SCHEDULE_QUEUE was acked."""
    js = h.nc.jetstream()

    async def loop():
        while True:
            info = await js.consumer_info(intake_queue.SCHEDULE_STREAM, subjects.Q_CONDUCTOR)
            if info.num_pending == 0 and info.num_ack_pending == 0:
                return
            await asyncio.sleep(0.01)

    await asyncio.wait_for(loop(), 10)


async def queue(h, r: str) -> None:
    req = GenerateRequest(request_id=r, prompt_token_ids=PROMPT, reply_subject=h.inbox)
    await bus.js_publish(h.nc.jetstream(), subjects.SCHEDULE_QUEUE, encode(req), msg_id=r)


async def test_a_queued_request_is_placed_claimed_and_acked(conductor):
    h, r = conductor, rid()
    await queue(h, r)
    task = await h.task()
    assert task.request.request_id == r and task.prefill_instance == "prefill-1"  # cached
    acc = await h.event()
    assert isinstance(acc, Accepted) and acc.prefill_instance == "prefill-1"
    claim = await intake_queue.claimed(h.nc.jetstream(), r)
    assert claim is not None and decode(claim, PrefillTask) == task
    await queue_drained(h)
    assert h.svc.resent == 0


async def test_a_claimed_request_is_sent_again_as_placed_not_placed_again(conductor):
    """A conductor died after claiming (maybe after dispatching) and before acking: the
    delivery that follows re-sends that placement, though the policy would pick the
    cached prefill-1 now."""
    h, r = conductor, rid()
    req = GenerateRequest(
        request_id=r,
        prompt_token_ids=PROMPT,
        reply_subject=h.inbox,
        block_size=32,
        block_hashes=HASHES,
    )
    earlier = PrefillTask(
        request=req,
        conductor_id="conductor-dead",
        prefill_instance="prefill-0",
        decode_instance="decode-0",
        prefill_node="np0",
        decode_node="nd0",
        expected_hit_blocks=0,
        placed_ts=time.time(),
    )
    assert (await intake_queue.claim(h.nc.jetstream(), r, encode(earlier)))[1]
    await queue(h, r)
    task = await h.task()
    assert task == earlier
    acc = await h.event()
    assert acc == Accepted(
        request_id=r,
        prefill_instance="prefill-0",
        decode_instance="decode-0",
        cached_tokens=0,
        est_ttft_s=earlier.est_ttft_s,
    )
    await queue_drained(h)
    assert h.svc.resent == 1
    assert r not in h.svc.pending  # booked by nobody here: the dead conductor placed it


async def test_admission_forwards_a_redelivered_request_without_deciding_again(nats_url):
    """Under a load it rejects a new request at, admission forwards one it was given
    before (it may have accepted it before dying)."""
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await intake_queue.ensure_streams(
        js, [intake_queue.INTAKE_STREAM, intake_queue.SCHEDULE_STREAM]
    )
    await js.purge_stream(intake_queue.INTAKE_STREAM)
    # Play the admission that died: take the request and never ack it (nak: at once again).
    got: asyncio.Queue = asyncio.Queue()
    dead = await js.subscribe(
        subjects.INTAKE,
        queue=subjects.Q_ADMISSION,
        durable=subjects.Q_ADMISSION,
        stream=intake_queue.INTAKE_STREAM,
        cb=got.put,
        manual_ack=True,
        config=intake_queue.consumer_config(subjects.Q_ADMISSION, subjects.INTAKE),
    )
    h = AdmissionHarness()
    again, fresh = rid(), rid()
    scheduled = await nc.subscribe(subjects.SCHEDULE_QUEUE)
    try:
        inbox = nc.new_inbox()
        req = GenerateRequest(request_id=again, prompt_token_ids=PROMPT, reply_subject=inbox)
        await bus.js_publish(js, subjects.INTAKE, encode(req), msg_id=again)
        m = await asyncio.wait_for(got.get(), 5)
        await dead.unsubscribe()
        await m.nak()
        await h.start(nats_url, block_size=32, ttft_slo_s=30.0, tbt_slo_s=0.1, policy="early")
        await h.loads(prefill_work=100.0)  # far over the TTFT SLO: a new request gets 429
        fwd = decode((await scheduled.next_msg(timeout=5)).data, GenerateRequest)
        assert fwd.request_id == again and fwd.reply_subject == inbox
        # The same load rejects a request delivered for the first time.
        r2 = GenerateRequest(request_id=fresh, prompt_token_ids=PROMPT, reply_subject=h.inbox)
        await bus.js_publish(js, subjects.INTAKE, encode(r2), msg_id=fresh)
        err = await h.event()
        assert isinstance(err, Error) and err.code == ErrorCode.REJECTED and err.request_id == fresh

        async def acked() -> None:  # both
            while True:
                info = await js.consumer_info(intake_queue.INTAKE_STREAM, subjects.Q_ADMISSION)
                if info.num_ack_pending == 0 and info.num_pending == 0:
                    return
                await asyncio.sleep(0.01)

        await asyncio.wait_for(acked(), 10)
    finally:
        await h.close()
        await nc.close()


@pytest.fixture
async def rig(nats_url):
    r = await Rig().start(nats_url)
    yield r
    await r.close()


async def test_a_prefill_task_sent_twice_runs_once(rig):
    prompt = rig.prompt(100, seed=3)
    t = rig.task(prompt, p_hit=0, d_hit=0, max_tokens=3)
    q = await rig.submit(t)
    await rig.tnc.publish(subjects.prefill_tasks(rig.pi), encode(t))  # a conductor's resend
    events = await until_terminal(q)
    assert tokens_of(events) == rig.reference(prompt, 3)
    pc = await rig.stats("prefill", rig.pi)
    assert pc["tasks_done"] == 1 and pc["tasks_duplicate"] == 1


class _Redelivery:
    """A JetStream message delivered the second time (its first ack was lost)."""

    reply = None

    class metadata:  # noqa: N801 - stands in for nats.aio.msg.Msg.metadata
        num_delivered = 2


async def test_a_redelivered_request_this_admission_rejected_stays_rejected(nats_url):
    h = await AdmissionHarness().start(
        nats_url, block_size=32, ttft_slo_s=30.0, tbt_slo_s=0.1, policy="early"
    )
    try:
        await h.loads(prefill_work=100.0)
        js = h.nc.jetstream()
        rejected, other = rid(), rid()
        req = GenerateRequest(request_id=rejected, prompt_token_ids=PROMPT, reply_subject=h.inbox)
        await bus.js_publish(js, subjects.INTAKE, encode(req), msg_id=rejected)
        err = await h.event()
        assert isinstance(err, Error) and err.code == ErrorCode.REJECTED
        # Its ack lost, it comes again: answered already, not forwarded; one this
        # admission never decided is (an admission that died may have accepted it).
        await h.svc._on_request(req, _Redelivery(), durable=True)
        req2 = GenerateRequest(request_id=other, prompt_token_ids=PROMPT, reply_subject=h.inbox)
        await h.svc._on_request(req2, _Redelivery(), durable=True)
        fwd = decode((await h.scheduled.next_msg(timeout=5)).data, GenerateRequest)
        assert fwd.request_id == other
    finally:
        await h.close()


async def test_without_the_durable_intake_admission_forwards_on_core_schedule(nats_url):
    nc = await nats.connect(nats_url)
    core = await nc.subscribe(subjects.SCHEDULE)
    h = await AdmissionHarness().start(
        nats_url,
        block_size=32,
        ttft_slo_s=30.0,
        tbt_slo_s=0.1,
        policy="early",
        durable_intake=False,
    )
    try:
        await h.loads(prefill_work=0.0)
        r = rid()
        await h.send(encode(GenerateRequest(request_id=r, prompt_token_ids=PROMPT)))
        fwd = decode((await core.next_msg(timeout=5)).data, GenerateRequest)
        assert fwd.request_id == r and fwd.reply_subject == h.inbox
        assert h.svc.intake is None
    finally:
        await h.close()
        await nc.close()


async def test_two_copies_starting_at_once_share_the_work_queue(nats_url):
    """Both copies bind to one consumer and one deliver subject: each gets messages
    (with a deliver inbox drawn per copy, one copy's create replaced the other's
    subject, or failed with "consumer name already in use", and one got nothing)."""
    ncs = [await nats.connect(nats_url) for _ in range(3)]
    got: dict[int, list[bytes]] = {0: [], 1: []}
    subs = [bus.Subscriptions(nc) for nc in ncs[:2]]
    durable = f"twins-{uuid.uuid4().hex[:6]}"
    # A work queue of its own: a work-queue stream takes one consumer per subject, and
    # the server is shared with the tests above, whose conductors' consumer stays.
    stream, subject = durable.upper(), f"{durable}.queue"
    try:
        js = ncs[2].jetstream()
        await js.add_stream(
            name=stream, subjects=[subject], retention=api.RetentionPolicy.WORK_QUEUE
        )

        def handler(k):
            async def handle(m):
                got[k].append(m.data)
                await m.ack()

            return handle

        copies = [
            intake_queue.QueueConsumer(ncs[k], stream, subject, durable, handler(k)) for k in (0, 1)
        ]
        await asyncio.gather(*(c.start(s) for c, s in zip(copies, subs, strict=True)))
        for nc in ncs[:2]:
            await nc.flush()
        n = 64
        for i in range(n):
            await bus.js_publish(js, subject, b"m%d" % i, msg_id=f"{durable}-{i}")
        async with asyncio.timeout(10):
            while len(got[0]) + len(got[1]) < n:
                await asyncio.sleep(0.01)
        assert got[0] and got[1], {k: len(v) for k, v in got.items()}
        assert sorted(got[0] + got[1]) == sorted(b"m%d" % i for i in range(n))  # each once
    finally:
        for s in subs:
            await s.close()
        for nc in ncs:
            await nc.close()


async def test_a_consumer_lookup_that_times_out_at_start_is_tried_again(nats_url):
    """A busy server answers the consumer lookup late (nats-py raises TimeoutError): the
    copy starting tries again and binds, instead of its service exiting at start-up
    (seen in a fresh-clone make test: a conductor exited 1)."""
    nc = await nats.connect(nats_url)
    subs = bus.Subscriptions(nc)
    durable = f"late-{uuid.uuid4().hex[:6]}"
    stream, subject = durable.upper(), f"{durable}.queue"
    got: list[bytes] = []
    try:
        js = nc.jetstream()
        await js.add_stream(
            name=stream, subjects=[subject], retention=api.RetentionPolicy.WORK_QUEUE
        )

        async def handle(m):
            got.append(m.data)
            await m.ack()

        consumer = intake_queue.QueueConsumer(nc, stream, subject, durable, handle)
        real, failures = consumer.js.subscribe, [0]

        async def late(*a, **kw):
            if failures[0] < 2:
                failures[0] += 1
                raise nats.errors.TimeoutError
            return await real(*a, **kw)

        consumer.js.subscribe = late  # type: ignore[method-assign]
        await consumer.start(subs)
        assert failures[0] == 2
        await nc.flush()
        await bus.js_publish(js, subject, b"after", msg_id=f"{durable}-0")
        async with asyncio.timeout(10):
            while not got:
                await asyncio.sleep(0.01)
        assert got == [b"after"]
    finally:
        await subs.close()
        await nc.close()


async def test_a_claim_the_stream_cannot_store_in_time_places_unclaimed_once(
    conductor, monkeypatch
):
    """The PLACED stream electing a leader (its server died): the placement goes out
    unclaimed after the patience, and a stored copy of the same id delivered later is
    dropped by this conductor, not placed twice."""
    h, r = conductor, rid()

    async def stalled(*a, **kw):
        raise TimeoutError("no stream leader")

    monkeypatch.setattr(intake_queue, "claim", stalled)
    await queue(h, r)
    task = await h.task()
    assert task.request.request_id == r
    assert isinstance(await h.event(), Accepted)
    await queue_drained(h)
    await queue(h, r)  # the same id stored again (e.g. published twice across a failover)
    await queue_drained(h)
    assert h.tasks.pending_msgs == 0 and h.events.pending_msgs == 0


async def test_a_forward_the_work_queue_cannot_store_in_time_goes_on_core_schedule(
    nats_url, monkeypatch
):
    """SCHEDULE_QUEUE electing a leader: admission forwards on core SCHEDULE after its
    patience (marked core_path, so the conductor keeps it off JetStream too); a request
    the gateway already sent on the core path goes there at once."""
    nc = await nats.connect(nats_url)
    core = await nc.subscribe(subjects.SCHEDULE)
    h = await AdmissionHarness().start(
        nats_url,
        block_size=32,
        ttft_slo_s=30.0,
        tbt_slo_s=0.1,
        policy="early",
        durable_intake=True,
        intake_patience_s=0.2,
    )
    real = bus.js_publish

    async def stalled(js, subject, *a, **kw):
        if subject == subjects.SCHEDULE_QUEUE:
            raise TimeoutError("no stream leader")
        return await real(js, subject, *a, **kw)

    monkeypatch.setattr(bus, "js_publish", stalled)
    try:
        await h.loads(prefill_work=0.0)
        for r, core_path in ((rid(), False), (rid(), True)):
            req = GenerateRequest(request_id=r, prompt_token_ids=PROMPT, core_path=core_path)
            await h.send(encode(req))
            fwd = decode((await core.next_msg(timeout=5)).data, GenerateRequest)
            assert fwd.request_id == r and fwd.core_path
        assert h.svc.bypasses == 1
    finally:
        await h.close()
        await nc.close()
