"""Crash-safe intake (``--durable-intake``; the default is the core path, whose dead
holders' requests the gateway resends: services.gateway.control_presence): the
JetStream work queues an accepted request travels on, and the placement claim that
makes its placement happen once.

    gateway --INTAKE (stream PERIGEE_INTAKE, work queue)--> admission
    admission --SCHEDULE_QUEUE (stream PERIGEE_SCHEDULE, work queue)--> conductors
    conductor: claim on PERIGEE_PLACED (one message per request id), PrefillTask, ack

Each hop is published with ``Nats-Msg-Id`` = the request id and waits for the stream's
ack (the stream keeps one copy per id within ``DUP_WINDOW_S``), and each consumer acks
a message only once its effect is out. A consumer that dies holding messages has them
redelivered to another one (or to itself, restarted) after ``ack_wait_s``.

Delivery is therefore at least once; the effect is made exactly once by request id:

- admission forwards a redelivered request without deciding again (it may have
  accepted it before it died, and what is accepted is served); the forward dedups on
  the id.
- a conductor claims a request before it dispatches it: the first claim of an id
  stores the PrefillTask; a later delivery (redelivered, or a second conductor) finds
  the claim and re-sends the *stored* task to the same prefill instance, which drops a
  task for a request id it already has (services.prefill.worker). So a placement is
  decided once, and a task whose first send died with its conductor is sent again.

What a client sees: before admission's forward is stored the request is not accepted
yet; if admission dies then, the gateway's copy is still on INTAKE and is decided by the
next admission (the client just waits the ack wait longer). Once stored on
SCHEDULE_QUEUE it is accepted and goes on whatever dies: Accepted, tokens, Finished.

Request ids are free text; the claim's subject is a digest of the id.
"""

import asyncio
import copy
import hashlib
from collections.abc import Awaitable, Callable
from typing import Any

import nats.errors
import nats.js.errors
import structlog
from nats.aio.msg import Msg as NatsMsg
from nats.js import api

from bus_schemas import subjects
from services.common import bus

log = structlog.get_logger()

INTAKE_STREAM = "PERIGEE_INTAKE"
SCHEDULE_STREAM = "PERIGEE_SCHEDULE"
PLACED_STREAM = "PERIGEE_PLACED"
DUP_WINDOW_S = 120.0
PLACED_MAX_AGE_S = 900.0  # longer than any redelivery of a request waits
# A message held by a copy that died goes to another after this long. A live copy
# touches every message it holds (``in_progress``) every third of it, however long the
# message waits in its queue or handler, so only a dead copy's messages come again.
ACK_WAIT_S = 2.0
# How long a publisher waits for a work queue's ack before it takes the core path. A
# stream's ack takes milliseconds; a stream without a leader (its server died) takes
# nats-server's Raft election, 4-9 s, which a request need not wait out.
PATIENCE_S = 1.0
# Request ids a conductor placed without a claim, remembered to drop a stored copy.
REMEMBER_UNCLAIMED = 10_000
# Each work queue holds at most this many requests (and bytes); past it a publish is
# refused (discard new), which its publisher answers as an overload, not a stall.
MAX_QUEUED = 100_000
MAX_QUEUED_BYTES = 1 << 30
# What a stream says while it has no leader (or is gone): the core path may take over.
STALLED = (
    TimeoutError,
    nats.errors.NoRespondersError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
)
# nats-server's JSStreamWrongLastSequence: the claim's subject already has a message.
WRONG_LAST_SEQUENCE = 10071
STREAM_NAME_IN_USE = 10058
CONSUMER_NAME_IN_USE = 10013


def placed_subject(request_id: str) -> str:
    return subjects.placed(hashlib.sha256(request_id.encode()).hexdigest()[:32])


def stream_configs(replicas: int) -> dict[str, api.StreamConfig]:
    def queue(name: str, subject: str) -> api.StreamConfig:
        return api.StreamConfig(
            name=name,
            subjects=[subject],
            retention=api.RetentionPolicy.WORK_QUEUE,
            storage=api.StorageType.FILE,
            num_replicas=replicas,
            duplicate_window=DUP_WINDOW_S,
            max_msgs=MAX_QUEUED,
            max_bytes=MAX_QUEUED_BYTES,
            discard=api.DiscardPolicy.NEW,
        )

    return {
        INTAKE_STREAM: queue(INTAKE_STREAM, subjects.INTAKE),
        SCHEDULE_STREAM: queue(SCHEDULE_STREAM, subjects.SCHEDULE_QUEUE),
        PLACED_STREAM: api.StreamConfig(
            name=PLACED_STREAM,
            subjects=[subjects.placed("*")],
            retention=api.RetentionPolicy.LIMITS,
            storage=api.StorageType.FILE,
            num_replicas=replicas,
            max_msgs_per_subject=1,
            max_age=PLACED_MAX_AGE_S,
            duplicate_window=DUP_WINDOW_S,
        ),
    }


async def ensure_streams(js: Any, names: list[str], timeout: float = 30.0) -> None:
    """Create the named streams (each service creates what it uses; creating one that
    exists with the same config is a no-op). Retries while a cluster elects leaders."""
    cfgs = stream_configs(bus.js_replicas())
    deadline = asyncio.get_running_loop().time() + timeout
    for name in names:
        while True:
            try:
                await js.add_stream(cfgs[name])
                break
            except nats.js.errors.BadRequestError as e:
                if e.err_code == STREAM_NAME_IN_USE:
                    await js.update_stream(cfgs[name])
                    break
                raise
            except (
                nats.errors.TimeoutError,
                nats.js.errors.ServiceUnavailableError,
                nats.errors.NoRespondersError,
                nats.js.errors.APIError,
            ) as e:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                log.warning("intake_stream_retry", stream=name, error=str(e))
                await asyncio.sleep(0.5)


async def claim(js: Any, request_id: str, task: bytes, timeout: float = 30.0) -> tuple[bytes, bool]:
    """Claim ``request_id``'s placement with ``task`` (its encoded PrefillTask). Returns
    the task that holds the claim and whether it is this one (False: an earlier
    placement of the id, to be re-sent as it is). Past ``timeout`` (the stream has no
    leader) the last error is raised."""
    subject = placed_subject(request_id)
    try:
        ack = await bus.js_publish(
            js,
            subject,
            task,
            msg_id=f"placed:{request_id}",
            headers={"Nats-Expected-Last-Subject-Sequence": "0"},
            timeout=timeout,
        )
        if not ack.duplicate:
            return task, True
    except nats.js.errors.APIError as e:
        if e.err_code != WRONG_LAST_SEQUENCE:
            raise
    stored = await js.get_last_msg(PLACED_STREAM, subject)
    return stored.data, False


async def claimed(js: Any, request_id: str) -> bytes | None:
    """The task that holds ``request_id``'s claim, or None."""
    try:
        stored = await js.get_last_msg(PLACED_STREAM, placed_subject(request_id))
    except nats.js.errors.NotFoundError:
        return None
    data: bytes = stored.data
    return data


def redelivered(m: NatsMsg) -> bool:
    """A message this consumer group was given before (its holder may have died)."""
    try:
        return m.metadata.num_delivered > 1
    except Exception:  # noqa: BLE001 - not a JetStream message
        return False


def consumer_config(
    durable: str, subject: str, ack_wait_s: float = ACK_WAIT_S, max_inflight: int = 256
) -> api.ConsumerConfig:
    """A durable push consumer delivered to a queue group (``durable``): every copy of
    the service shares it, acks by hand, and the server redelivers what one of them
    held unacked for ``ack_wait_s``; at most ``max_inflight`` are out at once."""
    return api.ConsumerConfig(
        durable_name=durable,
        deliver_group=durable,
        # One deliver subject for every copy: nats-py would otherwise draw an inbox per
        # copy, and of two copies starting at once the second's create replaced the
        # first's subject (or failed: "consumer name already in use"), so one copy got
        # every message and the other none.
        deliver_subject=f"_INBOX.perigee-deliver.{durable}",
        ack_policy=api.AckPolicy.EXPLICIT,
        ack_wait=ack_wait_s,
        max_deliver=-1,
        max_ack_pending=max_inflight,
        filter_subject=subject,
    )


class QueueConsumer:
    """Takes a work queue with a durable consumer shared by every copy of a service
    (queue semantics) and hands each message to ``handle``, which acks it once its
    effect is out. ``concurrent``: each message in its own task, else in order.

    Push, not pull: a message goes out the moment it is stored (a pull batch would wait
    for the batch to fill or its request to expire)."""

    def __init__(
        self,
        nc: Any,
        stream: str,
        subject: str,
        durable: str,
        handle: Callable[[NatsMsg], Awaitable[None]],
        *,
        concurrent: bool = False,
        ack_wait_s: float = ACK_WAIT_S,
        max_inflight: int = 256,
    ) -> None:
        self.nc, self.js = nc, nc.jetstream()
        self.stream, self.subject, self.durable = stream, subject, durable
        self.handle, self.concurrent = handle, concurrent
        self.cfg = consumer_config(durable, subject, ack_wait_s, max_inflight)
        self.ack_wait_s = ack_wait_s
        self._order = asyncio.Lock()
        self._subs: bus.Subscriptions
        self._sub: Any = None

    async def start(self, subs: bus.Subscriptions, start_timeout_s: float = 30.0) -> None:
        """Bind to the durable consumer (created by the first copy), retrying while the
        server does not answer for up to ``start_timeout_s``."""
        self._subs = subs  # its close() cancels the handlers

        async def cb(m: NatsMsg) -> None:
            # Never block the delivery: a message waiting behind another (in order) is
            # held here, and touched while it waits, not in nats-py's pending queue.
            self._subs.spawn(self._run(m), name=f"{self.stream}:handler")

        loop = asyncio.get_running_loop()
        deadline = loop.time() + start_timeout_s
        in_use = 0
        while True:
            try:
                self._sub = await self.js.subscribe(
                    self.subject,
                    queue=self.durable,
                    durable=self.durable,
                    stream=self.stream,
                    cb=cb,
                    manual_ack=True,
                    config=copy.copy(self.cfg),
                )
                return
            except nats.js.errors.BadRequestError as e:
                # Another copy created the consumer between our lookup and our create:
                # the next try finds it and binds to it.
                in_use += 1
                if e.err_code != CONSUMER_NAME_IN_USE or in_use == 3:
                    raise
            except STALLED as e:
                # A busy or electing server answers the consumer lookup late: a copy
                # starting then waits for it instead of exiting.
                if loop.time() > deadline:
                    raise
                log.warning("intake_consumer_retry", stream=self.stream, error=repr(e))
                await asyncio.sleep(0.5)

    async def close(self) -> None:
        """Stop taking messages (the durable consumer stays for the other copies)."""
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # noqa: BLE001 - connection may already be gone
                pass

    async def _run(self, m: NatsMsg) -> None:
        keep = asyncio.create_task(self._keep_alive(m), name=f"{self.stream}:in-progress")
        try:
            if self.concurrent:
                await self.handle(m)
            else:
                async with self._order:  # FIFO: in the order delivered
                    await self.handle(m)
        except Exception:  # noqa: BLE001 - not acked: it comes again after ack_wait
            log.exception("intake_handler_failed", stream=self.stream)
        finally:
            keep.cancel()

    async def _keep_alive(self, m: NatsMsg) -> None:
        """Tell the server this copy is alive and still has ``m``, until it is handled."""
        period = max(0.05, self.ack_wait_s / 3)
        while True:
            await asyncio.sleep(period)
            try:
                await m.in_progress()
            except Exception:  # noqa: BLE001 - connection gone: the ack wait decides
                return


def add_patience_argument(ap: Any, what: str = "a request") -> None:
    """``--intake-patience`` (gateway, admission, conductor): see PATIENCE_S."""
    ap.add_argument(
        "--intake-patience",
        type=float,
        default=PATIENCE_S,
        help=f"seconds to wait for JetStream to store {what} before taking the core NATS "
        "path instead (a stream electing a leader after a nats-server died takes 4-9 s); "
        "0: wait",
    )
