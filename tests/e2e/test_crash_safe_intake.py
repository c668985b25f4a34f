"""Crash-safe intake (services.common.intake_queue): a SIGKILLed admission or conductor
that held accepted requests loses none of them, and none is placed twice. Real
nats-server (JetStream), real processes, the mock engine, a supervised stack.

Each fault is made certain to hold requests: the service is SIGSTOPped, a burst is
sent (the stopped process's outstanding pull takes some of it, the rest waits in the
stream), then it is SIGKILLed. The stream's redelivery count proves it held some."""

import asyncio
import json
import os
import signal
import uuid
from pathlib import Path

import aiohttp
import nats
import nats.errors
import pytest
from nats.js.errors import NotFoundError

from bus_schemas import subjects
from bus_schemas.codec import decode, encode
from bus_schemas.placement import PrefillTask
from bus_schemas.requests import (
    Accepted,
    Error,
    Finished,
    GenerateRequest,
    SamplingParams,
    Tokens,
    stream_event_decoder,
)
from perigee.supervise import RestartPolicy
from services.common import bus, intake_queue
from tests.e2e.conftest import make_stack
from tests.e2e.helpers import worker_stats
from tests.e2e.sse import stream

pytestmark = pytest.mark.e2e

BURST = 24
MAX_TOKENS = 4
DEADLINE_S = 90.0


def supervised_stack(tmp_path_factory, name: str, **kw):
    """2 prefill + 2 decode + 2 conductors on the mock, restarted when one dies."""
    return make_stack(
        tmp_path_factory,
        name,
        engine="mock",
        prefill=2,
        decode=2,
        conductors=2,
        speedup="100",
        supervise=True,
        restart_policy=RestartPolicy(max_restarts=3, window_s=600.0, backoff_s=0.2),
        **kw,
    )


@pytest.fixture(scope="module")
def intake_stack(tmp_path_factory):
    s = supervised_stack(tmp_path_factory, "intake", durable_intake=True)
    s.start()
    yield s
    s.stop()


async def redelivered(nc, stream: str, durable: str) -> int:
    """Redeliveries so far: deliveries (consumer sequence) past the messages delivered
    (stream sequence; every message of the stream reaches this one consumer)."""
    info = await nc.jetstream().consumer_info(stream, durable)
    return info.delivered.consumer_seq - info.delivered.stream_seq


class TaskLog:
    """Every PrefillTask on the bus, by request id: a request placed twice would show
    two different placements."""

    def __init__(self) -> None:
        self.by_rid: dict[str, list[PrefillTask]] = {}

    async def start(self, nc) -> "TaskLog":
        async def cb(m):
            t = decode(m.data, PrefillTask)
            self.by_rid.setdefault(t.request.request_id, []).append(t)

        await nc.subscribe(subjects.prefill_tasks("*"), cb=cb)
        await nc.flush()
        return self

    def placements(self, rid: str) -> set[tuple[str, str]]:
        return {(t.prefill_instance, t.decode_instance) for t in self.by_rid.get(rid, [])}


async def prefill_counter(s, name: str) -> int:
    return sum(
        [(await worker_stats(s.nats_url, "prefill", f"prefill-{i}")).get(name, 0) for i in range(2)]
    )


async def tasks_done(s) -> int:
    return await prefill_counter(s, "tasks_done")


def send_burst(http: aiohttp.ClientSession, url: str, prompt: str) -> list[asyncio.Future]:
    """BURST streamed completions of MAX_TOKENS each, distinct prompts, under way."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    return [
        asyncio.ensure_future(stream(http, url, {**body, "prompt": f"{i} {prompt}"}))
        for i in range(BURST)
    ]


def assert_served(results) -> None:
    """Every stream of a burst ended well, with every token asked for."""
    for r in results:
        assert r.status == 200 and r.done and r.error is None, (r.status, r.error)
        assert r.usage["completion_tokens"] == MAX_TOKENS


async def test_sigkilled_admission_loses_no_accepted_request(intake_stack):
    """The gateway's requests wait in the INTAKE work queue; those the dead admission
    held are redelivered to its restarted self and forwarded once."""
    s = intake_stack
    nc = await nats.connect(s.nats_url)
    tasks = await TaskLog().start(nc)
    before = await redelivered(nc, intake_queue.INTAKE_STREAM, subjects.Q_ADMISSION)
    done_before = await tasks_done(s)
    try:
        old = s.children["admission"].proc
        os.kill(old.pid, signal.SIGSTOP)
        async with aiohttp.ClientSession() as http:
            burst = send_burst(http, s.url, "crash-safe intake")
            # Every request of the burst is stored before admission dies: the stream has them.
            js = nc.jetstream()

            async def stored() -> None:
                while True:
                    info = await js.consumer_info(intake_queue.INTAKE_STREAM, subjects.Q_ADMISSION)
                    if info.num_pending + info.num_ack_pending >= BURST:
                        return
                    await asyncio.sleep(0.05)

            await asyncio.wait_for(stored(), DEADLINE_S)
            s.kill("admission", signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*burst), DEADLINE_S)
        assert s.restarts.get("admission") == 1
        assert_served(results)
        # The dead admission held some (delivered, never acked): they came again.
        assert await redelivered(nc, intake_queue.INTAKE_STREAM, subjects.Q_ADMISSION) > before
        # Each request placed once, computed once.
        assert all(len(tasks.placements(rid)) == 1 for rid in tasks.by_rid), tasks.by_rid
        assert len(tasks.by_rid) == BURST
        assert await tasks_done(s) - done_before == BURST
    finally:
        await nc.close()


async def send(js, nc, rid: str, prompt: list[int]) -> asyncio.Queue:
    """Publish a request on INTAKE as the gateway does; its events arrive on the queue."""
    q: asyncio.Queue = asyncio.Queue()
    inbox = nc.new_inbox()
    await nc.subscribe(inbox, cb=q.put)
    req = GenerateRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        reply_subject=inbox,
        sampling=SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
    )
    await bus.js_publish(js, subjects.INTAKE, encode(req), msg_id=rid)
    return q


async def outcome(q: asyncio.Queue) -> tuple[Finished, list[Accepted], int]:
    dec = stream_event_decoder()
    accepted, tokens = [], 0
    while True:
        ev = dec.decode((await q.get()).data)
        if isinstance(ev, Accepted):
            accepted.append(ev)
        elif isinstance(ev, Tokens):
            tokens += len(ev.token_ids)
        elif isinstance(ev, Error):
            raise AssertionError(f"{ev.request_id}: {ev.code} {ev.message}")
        elif isinstance(ev, Finished):
            return ev, accepted, tokens


async def test_sigkilled_conductor_loses_no_request_and_places_none_twice(intake_stack):
    """One of two conductors dies holding requests off SCHEDULE_QUEUE: the other gets
    them after the ack wait and places each once (a placement already claimed is sent
    again as it was, and its prefill instance drops the copy)."""
    s = intake_stack
    nc = await nats.connect(s.nats_url)
    js = nc.jetstream()
    tasks = await TaskLog().start(nc)
    before = await redelivered(nc, intake_queue.SCHEDULE_STREAM, subjects.Q_CONDUCTOR)
    done_before = await tasks_done(s)
    try:
        victim = s.children["conductor-1"].proc
        os.kill(victim.pid, signal.SIGSTOP)
        rids = [f"intake-{uuid.uuid4().hex[:10]}" for _ in range(BURST)]
        queues = [await send(js, nc, rid, [7 + i, *range(100, 160)]) for i, rid in enumerate(rids)]

        # Wait until the stopped conductor holds some of the burst (its pull was open).
        async def held() -> None:
            while True:
                info = await js.consumer_info(intake_queue.SCHEDULE_STREAM, subjects.Q_CONDUCTOR)
                if info.num_ack_pending > 0 and info.delivered.consumer_seq >= BURST:
                    return
                await asyncio.sleep(0.05)

        await asyncio.wait_for(held(), DEADLINE_S)
        s.kill("conductor-1", signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*(outcome(q) for q in queues)), DEADLINE_S)
        for fin, accepted, n in results:
            assert fin.finish_reason == "length" and n == MAX_TOKENS, (fin, n)
            # One placement per request, whatever was sent again.
            assert len({(a.prefill_instance, a.decode_instance) for a in accepted}) == 1
        assert await redelivered(nc, intake_queue.SCHEDULE_STREAM, subjects.Q_CONDUCTOR) > before
        for rid in rids:
            assert len(tasks.placements(rid)) == 1, tasks.by_rid.get(rid)
        assert await tasks_done(s) - done_before == BURST  # computed once each
        # Every request's claim is on the stream.
        for rid in rids:
            try:
                await js.get_last_msg(intake_queue.PLACED_STREAM, intake_queue.placed_subject(rid))
            except NotFoundError:
                pytest.fail(f"{rid} has no placement claim")
    finally:
        await nc.close()


async def test_a_worker_can_neither_feed_nor_drain_the_intake_queues(intake_stack):
    """Its login may not publish on the queues nor open a consumer on their streams
    (which would take requests off them)."""
    s = intake_stack
    login = json.loads((Path(s.cfg.log_dir) / "nats" / "credentials.json").read_text())
    errors: list[str] = []

    async def on_error(e: Exception) -> None:
        errors.append(str(e).lower())

    nc = await nats.connect(
        s.nats.url,
        user="prefill-0",
        password=login["users"]["prefill-0"],
        allow_reconnect=False,
        error_cb=on_error,
    )
    js = nc.jetstream()
    try:
        for subject in (subjects.INTAKE, subjects.SCHEDULE_QUEUE):
            with pytest.raises(nats.errors.Error):  # no ack: the publish never got there
                await js.publish(subject, b"{}", timeout=2)
        with pytest.raises(nats.errors.Error):
            await js.pull_subscribe(
                subjects.SCHEDULE_QUEUE, durable="thief", stream=intake_queue.SCHEDULE_STREAM
            )
        # ... because the server refused each, not for want of an answer.
        for subject in (
            subjects.INTAKE,
            subjects.SCHEDULE_QUEUE,
            f"$js.api.consumer.info.{intake_queue.SCHEDULE_STREAM.lower()}.thief",
        ):
            assert any(f'permissions violation for publish to "{subject}"' in e for e in errors), (
                subject,
                errors,
            )
    finally:
        await nc.close()
