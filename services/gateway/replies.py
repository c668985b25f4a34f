"""The gateway's side of the bus: one wildcard subscription demultiplexed into
per-request queues, load reports feeding the watchdog, and its periodic sweep.

Lifecycle of a request's queue:

    open(rid)  -> queue registered, watchdog tracks rid
    events     -> ``perigee.gw.<gateway>.<rid>`` decoded once here, watchdog fed,
                  the event put on the queue (unknown rids are dropped)
    sweep      -> a watchdog verdict puts a local :class:`Error` on the queue
    close(rid) -> queue and watchdog entry removed

No per-request subscription: ``perigee.gw.<gateway>.>`` is subscribed once at start.

Migration (services.gateway.resend): a death verdict for a request whose client
has not got every token resends it (``--migration-limit`` times at most) under a new
attempt id with its own reply subject; from then on only that attempt's events reach
the request's queue, their token indices shifted by the tokens the client already
has, so the stream goes on with no token lost or repeated. The dead attempt is
cancelled (a worker wrongly judged dead stops; its late events are dropped here).
A NATS server that dies loses what was in flight through it (core NATS delivers at most
once): its clients announce their reconnection on ``perigee.bus.reconnected``
(services.common.bus.connect) and every request sent is resumed the same way, not
counted against ``--migration-limit`` (no worker died). So is, on the core path, every
request not placed yet when an admission or conductor process dies (its presence beats
stop, or it beats under a newer incarnation: services.gateway.control_presence).

The sweep judges liveness from load reports, which reach the gateway through its own
NATS connection. When that input lags (a gateway busy with a thousand streams reads
its socket late), every instance looks silent at once. So each sweep publishes
an echo to ``perigee.gw.<gateway>`` and only gives death verdicts while the echoes come
back within half of ``dead_after_s`` (or 2.5 sweep intervals, if longer).
"""

import asyncio
import contextlib
import contextvars
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg as NatsMsg

from bus_schemas import subjects
from bus_schemas.codec import BadMessage, decode, encode
from bus_schemas.control import Presence
from bus_schemas.requests import (
    Accepted,
    CancelAck,
    CancelRequest,
    Error,
    ErrorCode,
    Finished,
    GenerateRequest,
    StreamEvent,
    Tokens,
    unbundled,
)
from bus_schemas.roles import ROLES, Role
from services.common import bus, intake_queue, metrics, presence
from services.common.bus import publish
from services.common.kv_errors import instance_restarted, restarted_instance, store_failure
from services.common.tasks import cancel_and_wait
from services.gateway import resend
from services.gateway.control_presence import ControlPresence
from services.gateway.lateness import Lateness
from services.gateway.watchdog import Verdict, Watchdog
from tracing import inject

log = structlog.get_logger()

# The "role" of a resume after a NATS server died (nobody died; messages were lost).
BUS_LOSS = "bus"
# A request is resumed after bus losses at most this many times (a loop of notices must
# not re-run its prefill for ever).
MAX_BUS_RESUMES = 3


class LocalError(Error, tag="error"):
    """An :class:`Error` the gateway made itself (watchdog, shutdown, no responders);
    ``cancel``: the backend may still be working on the request and must be told."""

    cancel: bool = True


NO_RESPONDERS = "503"  # NATS status header on a reply subject: nobody subscribes the subject
# A migration answered "no responders" is sent again this many times (backing off from
# 0.1 s to 1 s: about 10 s in all). Its client was accepted, and the usual cause is the
# bus healing: admission reconnecting to another NATS server after one died, its
# subscription not yet known cluster-wide. So is a first send on the core path once an
# admission was heard: it is restarting.
RESEND_TRIES = 14


class _Heartbeat(msgspec.Struct):
    """What the gateway reads of a load report: not strict, other fields skipped."""

    incarnation: int = 0
    step_time_s: float | None = None  # decode reports only
    node: str = ""  # the store the instance shares a host with


_heartbeat = msgspec.json.Decoder(_Heartbeat)
_presence = msgspec.json.Decoder(Presence)

# A cancel is repeated (backing off from CANCEL_FIRST_WAIT_S to CANCEL_MAX_WAIT_S) until
# every instance holding the request acknowledged it or its incarnation ended.
CANCEL_FIRST_WAIT_S = 0.25
CANCEL_MAX_WAIT_S = 2.0
# An instance silent this long is forgotten (its name may never come back).
FORGET_INSTANCE_S = 600.0


@dataclass(slots=True)
class _Flight:
    """One client request: its queue, what the client got, its current attempt."""

    queue: asyncio.Queue
    request: GenerateRequest | None = None  # as first sent (None until sent)
    generated: list[int] = field(default_factory=list)  # token ids the client has, in order
    attempt: int = 0  # migrations so far
    current: str = ""  # the attempt id whose events are routed
    offset: int = 0  # the current attempt's index 0 is this generated token
    bus_resumes: int = 0  # attempts resent after a bus loss (not a worker's death)
    resent: GenerateRequest | None = None  # the current attempt, when it is a migration
    resend_tries: int = 0  # its sends answered "no responders" so far
    wait_until: float = 0.0  # a migration waiting for a live instance: until then (monotonic)
    store_retries: int = 0  # attempts resent after a store failure, within the wait
    store_wait_until: float = 0.0  # store failures are waited out until then (monotonic)
    # n > 1: tokens the client has of each sequence after the first (sequence 0's are
    # ``generated``)
    seq_counts: dict[int, int] = field(default_factory=dict)
    # Its current attempt went on the core path: an admission or conductor that dies
    # before placing it takes it along (services.gateway.control_presence).
    on_core: bool = False
    # The context it was opened in (its gateway.request span, its request id for the
    # logs): what is sent for it from the background runs in it (ReplyRouter._spawn).
    ctx: contextvars.Context | None = None


class ReplyRouter:
    """Routes every stream event to its request's queue and sweeps what the watchdog fails."""

    def __init__(
        self,
        nc: NATS,
        gateway_id: str,
        watchdog: Watchdog,
        migration_limit: int = 0,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.nc = nc
        self.gateway_id = gateway_id
        self.watchdog = watchdog
        self.migration_limit = migration_limit
        self.eos_token_ids = tuple(eos_token_ids)
        self.migrations = 0
        # A migration answered "no live ... instance" is sent again, for up to this long,
        # as an instance of that role comes back (a restart of the only one).
        self.migration_wait_s = 0.0
        self.migration_waits = 0  # such answers waited out (a send again each)
        self.resends_unanswered = 0  # migration sends answered "no responders"
        # Requests go on the INTAKE work queue (stored before send returns: crash-safe,
        # services.common.intake_queue) rather than core NATS REQUESTS.
        self.durable_intake = False
        # Past this, a request the intake did not store goes on the core path under a new
        # attempt id (0: wait as long as the intake takes).
        self.intake_patience_s = intake_queue.PATIENCE_S
        self.bypasses = 0  # requests sent on the core path because the intake stalled
        self._prefix = subjects.gateway_reply(gateway_id, "")
        self._flights: dict[str, _Flight] = {}
        self._routes: dict[str, str] = {}  # attempt id -> client request id
        self._nonces: dict[str, str] = {}  # attempt id -> its reply subject's nonce
        self.forged_events = 0  # events on a known attempt's subject with a wrong nonce
        self._bg: set[asyncio.Task] = set()
        self._subs: list = []
        self._sweeper: asyncio.Task | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self.bad_events = 0
        self.roles: dict[str, str] = {}  # instance -> role, from its load reports
        self.nodes: dict[str, str] = {}  # instance -> its store's node, from its reports
        # Not matched by the replies wildcard (``>`` needs one more token).
        self._echo_subject = self._prefix.rstrip(".")
        self._echo_rx = time.monotonic()  # when the last echo came back
        self._echo_lag = 0.0  # how late it came back
        self.stale_sweeps = 0
        self._sweep_interval = 0.0
        # A NATS server died: who reconnected since the last resume pass, and whether
        # one is due (_on_bus_reconnected).
        self.bus_settle_s = 0.25
        self._bus_lost: set[str] = set()
        self._bus_pass_due = False
        self.bus_passes = 0
        # Cancels of requests not placed yet: attempt id -> (reason, when), sent again to
        # the instances their Accepted names when it comes (bounded by the timeout).
        self._unplaced_cancels: dict[str, tuple[str, float]] = {}
        self._cancelling: set[asyncio.Task] = set()
        self.cancels_acked = 0  # targeted cancels every holder acknowledged
        self.cancel_sends = 0  # CancelRequest messages published
        self.lateness = Lateness()  # requests waiting for their first token, and when due
        # Admission and conductor processes heard beating, and those that died since the
        # last resume pass (kind:name): the core path's requests they may have held.
        self.control = ControlPresence(watchdog.clock, watchdog.dead_after_s)
        self._control_lost: set[str] = set()
        self.control_deaths = 0

    async def start(self, sweep_interval_s: float | None) -> None:
        self._subs.append(
            await self.nc.subscribe(subjects.gateway_replies(self.gateway_id), cb=self._on_reply)
        )
        self._subs.append(await self.nc.subscribe(subjects.LOAD_ALL, cb=self._on_load))
        self._subs.append(await self.nc.subscribe(self._echo_subject, cb=self._on_echo))
        self._subs.append(
            await self.nc.subscribe(subjects.BUS_RECONNECTED, cb=self._on_bus_reconnected)
        )
        self._subs.append(await self.nc.subscribe(subjects.PRESENCE_ALL, cb=self._on_presence))
        # nats-py writes flush()'s PING straight to the socket, ahead of a SUB still in
        # its pending buffer: only the second PONG proves the server has the SUBs.
        await self.nc.flush()
        await self.nc.flush()
        if sweep_interval_s:
            self._sweep_interval = sweep_interval_s
            self._echo_rx = time.monotonic()
            self._sweeper = asyncio.create_task(
                self._sweep_loop(sweep_interval_s), name="gateway.sweep"
            )

    async def close(self) -> None:
        for t in list(self._cancelling):
            t.cancel()
        if self._sweeper is not None:
            await cancel_and_wait([self._sweeper])
        for s in self._subs:
            with contextlib.suppress(Exception):
                await s.unsubscribe()
        self._subs.clear()
        if self._bg:
            await asyncio.gather(*list(self._bg), return_exceptions=True)

    # ---- per request ---------------------------------------------------------------
    def reply_subject(self, request_id: str) -> str:
        """``perigee.gw.<gateway>.<attempt id>.<nonce>``: the nonce (drawn once per attempt)
        makes the subject a capability. Any worker may publish on reply subjects (it
        streams its own requests' tokens), but only the instances a request was placed on
        (and admission and the conductor) are told its subject, so no other can inject
        events into its stream."""
        nonce = self._nonces.get(request_id)
        if nonce is None:
            nonce = self._nonces[request_id] = secrets.token_urlsafe(12)
        return f"{self._prefix}{request_id}.{nonce}"

    def open(self, request_id: str) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self._flights[request_id] = _Flight(q, current=request_id, ctx=contextvars.copy_context())
        self._routes[request_id] = request_id
        self._idle.clear()
        self.watchdog.track(request_id)
        return q

    def current_attempt(self, request_id: str) -> str:
        """The id the backend knows the request by now (it changes with a migration)."""
        f = self._flights.get(request_id)
        return f.current if f is not None else request_id

    def placement(self, request_id: str) -> tuple[tuple[str, int], ...]:
        """The (instance, incarnation) pairs holding the request's current attempt."""
        return self.watchdog.placement(request_id)

    def close_request(self, request_id: str) -> None:
        self.lateness.done(request_id)
        f = self._flights.pop(request_id, None)
        if f is not None:
            self._routes.pop(f.current, None)
            if self.watchdog.placement(request_id):
                self._nonces.pop(f.current, None)
            # else kept (until prune): a cancel of it waits for its Accepted on it
        self.watchdog.untrack(request_id)
        if not self._flights:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True once no request is in flight, False if ``timeout`` passed first."""
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
            return True
        except TimeoutError:
            return False

    def fail_all(self, code: int, message: str) -> None:
        """Every in-flight request ends with ``code`` now (shutdown)."""
        for rid, f in self._flights.items():
            self.watchdog.untrack(rid)
            f.queue.put_nowait(LocalError(request_id=rid, code=code, message=message))

    @property
    def in_flight(self) -> int:
        return len(self._flights)

    async def send(self, req: GenerateRequest) -> None:
        f = self._flights.get(req.request_id)
        if f is not None:
            f.request = req
        self.lateness.sent(req.request_id, self.watchdog.clock.now())
        await self._dispatch(req)

    async def _dispatch(self, req: GenerateRequest) -> None:
        """Send a request (or a migration's attempt) to admission: on the INTAKE work
        queue when durable (stored before this returns), else on core REQUESTS.

        An intake that has not stored it within ``intake_patience_s`` is electing a
        stream leader (a nats-server died): the request goes on the core path instead,
        under a new attempt id, so that the intake's copy, should it be stored after
        all, is another request: its events are routed nowhere and its placement is
        cancelled when its Accepted comes (:meth:`cancel` before placement)."""
        if not self.durable_intake or req.core_path:
            f = self._flights.get(self._routes.get(req.request_id, ""))
            if f is not None:
                f.on_core = True
            await publish(self.nc, subjects.REQUESTS, req, reply=req.reply_subject)
            return
        data, headers = encode(req), inject()
        bus.check_size(self.nc, subjects.INTAKE, data, headers)
        patience = self.intake_patience_s or 10.0
        try:
            await bus.js_publish(
                self.nc.jetstream(),
                subjects.INTAKE,
                data,
                msg_id=req.request_id,
                timeout=patience,
                headers=headers,
            )
        except intake_queue.STALLED as e:  # no leader: the core path (refused: raised)
            rid = self._routes.get(req.request_id, "")
            f = self._flights.get(rid)
            if not self.intake_patience_s or f is None or f.current != req.request_id:
                raise
            await self._bypass(f, req, e)

    async def _bypass(self, f: _Flight, req: GenerateRequest, why: Exception) -> None:
        rid, old = self._routes[req.request_id], req.request_id
        new = f"{old}-b{self.bypasses + 1}"
        bypassed = msgspec.structs.replace(
            req, request_id=new, reply_subject=self.reply_subject(new), core_path=True
        )
        self.bypasses += 1
        metrics.INTAKE_BYPASSES.labels(hop="gateway").inc()
        self._routes.pop(old, None)
        self._routes[new] = rid
        f.current = new  # old keeps its nonce: its late Accepted gets a cancel
        f.on_core = True
        if f.resent is req:
            f.resent = bypassed
        self._unplaced_cancels[old] = ("sent again on the core path", time.monotonic())
        log.warning(
            "intake_stalled_core_path",
            request_id=rid,
            attempt=new,
            waited_s=self.intake_patience_s,
            error=f"{type(why).__name__}: {why}",
        )
        await publish(self.nc, subjects.REQUESTS, bypassed, reply=bypassed.reply_subject)

    async def cancel(
        self, request_id: str, reason: str, targets: Sequence[tuple[str, int]] = ()
    ) -> None:
        """Tell the backend to stop ``request_id`` (an attempt id), as surely as the
        request reached it: to the ``targets`` (instance, incarnation) that hold it, the
        cancel is repeated until each acknowledged it or its incarnation ended (it died,
        or a new one reports under its name). Without targets (not placed yet) it is
        published once, and sent again to the placement when its Accepted comes."""
        if not targets:
            self._unplaced_cancels[request_id] = (reason, time.monotonic())
            await self._publish_cancel(CancelRequest(request_id=request_id, reason=reason))
            return
        task = asyncio.current_task()
        if task is not None:  # close() stops the repeats: nobody is left to tell then
            self._cancelling.add(task)
        try:
            await self._cancel_until_acked(request_id, reason, targets)
        finally:
            self._cancelling.discard(task)  # type: ignore[arg-type]

    async def _cancel_until_acked(
        self, request_id: str, reason: str, targets: Sequence[tuple[str, int]]
    ) -> None:
        pending = dict(targets)
        msg = CancelRequest(request_id=request_id, reason=reason, targets=dict(targets))
        try:
            inbox = self.nc.new_inbox()
            sub = await self.nc.subscribe(inbox)
        except Exception as e:  # noqa: BLE001 - NATS closing: nothing more can be said
            log.warning("cancel_publish_failed", request_id=request_id, error=str(e))
            return
        wait, acked = CANCEL_FIRST_WAIT_S, 0
        give_up = time.monotonic() + self.watchdog.request_timeout_s
        try:
            while self._still_held(pending) and time.monotonic() < give_up:
                await self._publish_cancel(msg, reply=inbox)
                until = time.monotonic() + wait
                while pending and (left := until - time.monotonic()) > 0:
                    try:
                        ack = await sub.next_msg(timeout=left)
                    except TimeoutError:
                        break
                    acked += self._on_cancel_ack(request_id, ack.data, pending)
                wait = min(CANCEL_MAX_WAIT_S, wait * 2)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        if acked == len(targets):
            self.cancels_acked += 1
        else:
            metrics.CANCELS_UNACKED.inc()

    def _still_held(self, pending: dict[str, int]) -> bool:
        """Drop from ``pending`` the instances whose incarnation ended; whether any is left."""
        live = self.watchdog.liveness
        for inst, inc in list(pending.items()):
            if not live.alive(inst) or (inc and live.incarnation(inst) > inc):
                del pending[inst]
        return bool(pending)

    def _on_cancel_ack(self, request_id: str, data: bytes, pending: dict[str, int]) -> bool:
        """Take an acknowledgement off ``pending``; whether it was one."""
        try:
            ack = decode(data, CancelAck)
        except BadMessage as e:
            log.warning("bad_cancel_ack", request_id=request_id, error=str(e))
            return False
        inc = pending.get(ack.instance)
        if ack.request_id != request_id or inc is None:
            return False
        if not (ack.refused or inc in (0, ack.incarnation)):
            return False
        del pending[ack.instance]
        return True

    async def _publish_cancel(self, msg: CancelRequest, reply: str = "") -> None:
        self.cancel_sends += 1
        try:
            await publish(self.nc, subjects.CANCEL, msg, reply=reply)
        except Exception as e:  # noqa: BLE001 - repeated while it matters
            log.warning("cancel_publish_failed", request_id=msg.request_id, error=str(e))

    def _placed_after_cancel(self, aid: str, ev: StreamEvent) -> None:
        """An event of an attempt no flight routes (finished, cancelled, migrated away): if
        it was cancelled before it was placed, its Accepted says whom to tell again."""
        pending = self._unplaced_cancels.get(aid)
        if pending is None or type(ev) is not Accepted:
            return
        del self._unplaced_cancels[aid]
        targets = [
            (i, n)
            for i, n in (
                (ev.prefill_instance, ev.prefill_incarnation),
                (ev.decode_instance, ev.decode_incarnation),
            )
            if i
        ]
        self._spawn(self.cancel(aid, pending[0], targets))

    def prune(self) -> None:
        """Bounded state: forget cancels whose Accepted never came and instances silent
        for long (names come and go with scaling); report each map's size."""
        horizon = time.monotonic() - self.watchdog.request_timeout_s
        for aid in [a for a, (_, t) in self._unplaced_cancels.items() if t < horizon]:
            del self._unplaced_cancels[aid]
        for aid in [a for a in self._nonces if a not in self._routes]:
            if aid not in self._unplaced_cancels:
                del self._nonces[aid]
        self.watchdog.forget_silent(FORGET_INSTANCE_S)
        for by_instance in (self.roles, self.nodes):
            for inst in [i for i in by_instance if not self.watchdog.liveness.known(i)]:
                del by_instance[inst]
        for name, size in (
            ("flights", len(self._flights)),
            ("routes", len(self._routes)),
            ("instances", len(self.roles)),
            ("unplaced_cancels", len(self._unplaced_cancels)),
            ("reply_nonces", len(self._nonces)),
            ("cancels_repeating", len(self._cancelling)),
        ):
            metrics.STATE_ENTRIES.labels(map=name).set(size)

    # ---- callbacks -----------------------------------------------------------------
    async def _on_reply(self, msg: NatsMsg) -> None:
        aid, _, nonce = msg.subject[len(self._prefix) :].partition(".")
        known = self._nonces.get(aid)
        if known is None or not secrets.compare_digest(nonce, known):
            if known is not None:
                self.forged_events += 1
                log.warning("forged_stream_event", attempt=aid)
            return  # not a subject this gateway gave out (or no longer)
        rid = self._routes.get(aid, "")
        f = self._flights.get(rid)
        if f is None:
            # finished, cancelled, timed out, or an attempt migrated away from
            if aid in self._unplaced_cancels and msg.data:
                with contextlib.suppress(BadMessage):
                    self._placed_after_cancel(aid, decode(msg.data, StreamEvent))
            return
        q = f.queue
        if not msg.data and msg.headers and msg.headers.get("Status") == NO_RESPONDERS:
            pending = f.resent
            if pending is None and f.request is not None and self.control.known("admission"):
                # The core path with an admission heard before: it is restarting (a
                # supervisor's, or a pod's container), so the request waits for it as the
                # durable intake would have kept it. With none ever heard, 503 at once.
                if f.current == f.request.request_id:
                    pending = f.request
            if pending is not None and f.resend_tries < RESEND_TRIES:
                self._spawn(self._resend_later(f, pending), f)
                return
            self.watchdog.untrack(rid)
            q.put_nowait(
                LocalError(
                    request_id=rid,
                    code=503,
                    cancel=False,
                    message=f"no service is subscribed to {subjects.REQUESTS} (is admission running?)",
                )
            )
            return
        try:
            ev = decode(msg.data, StreamEvent)
        except BadMessage as e:
            self.bad_events += 1
            log.warning("bad_stream_event", request_id=rid, error=str(e))
            return
        for one in unbundled(ev):
            if self._routes.get(aid) != rid or self._flights.get(rid) is not f:
                return  # the tokens before it ended this attempt (a gap, a migration)
            self._on_event(f, rid, one)

    def _on_event(self, f: _Flight, rid: str, ev: StreamEvent) -> None:
        """One stream event of flight ``f``'s current attempt, decoded."""
        q = f.queue
        wd = self.watchdog
        if self._lost_before(f, ev):
            # Events before this one never came (a NATS server died with them in
            # flight): showing it would cut tokens out of the stream, so it goes on
            # from the tokens the client has instead.
            log.warning("stream_gap", request_id=rid, attempt=f.attempt, have=len(f.generated))
            self._resolve(
                Verdict(
                    rid, ErrorCode.UNAVAILABLE, "stream events lost on the bus", dead_role=BUS_LOSS
                )
            )
            return
        if type(ev) is Accepted:
            self.lateness.placed(rid, wd.clock.now(), ev.est_ttft_s)
        elif type(ev) is Tokens or type(ev) is Finished:  # its first token (or all of them)
            overhead = self.lateness.first_token(
                rid, wd.clock.now(), ev.engine_s if type(ev) is Tokens else None
            )
            if overhead is not None:
                metrics.CONTROL_OVERHEAD.observe(max(0.0, overhead))
        else:  # its failure: it owes nothing more
            self.lateness.done(rid)
        if type(ev) is Tokens:
            wd.tokens(rid, ev.from_prefill, ev.incarnation)
            ev = self._note_tokens(f, ev)
        elif type(ev) is Accepted:
            restarted = wd.accepted(
                rid,
                ev.prefill_instance,
                ev.decode_instance,
                ev.prefill_incarnation,
                ev.decode_incarnation,
                ev.est_ttft_s,
            )
            if restarted:
                self.sweep()
            if f.attempt:
                return  # the client has its Accepted from the first attempt
        else:  # Finished / Error: terminal, the watchdog has nothing left to guard
            if type(ev) is Error and f.request is not None and store_failure(ev.code, ev.message):
                self._resolve(
                    Verdict(rid, ErrorCode.UNAVAILABLE, ev.message, dead_role=resend.STORE)
                )
                return
            if (
                type(ev) is Error
                and f.request is not None
                and instance_restarted(ev.code, ev.message)
            ):
                # A task reached a new incarnation of the instance placed on: the old one,
                # which the request was placed on, is dead.
                inst = restarted_instance(ev.message)
                placed = wd.placement(rid)
                role = Role.PREFILL if placed and placed[0][0] == inst else Role.DECODE
                self._resolve(
                    Verdict(
                        rid,
                        ErrorCode.UNAVAILABLE,
                        ev.message,
                        dead_role=role,
                        dead_instance=inst,
                        dead_incarnation=dict(placed).get(inst, 0),
                        placement=placed,
                    )
                )
                return
            if type(ev) is Error and self._wait_for_instance(f, ev):
                return
            wd.untrack(rid)
            if f.attempt:
                ev = self._from_attempt(f, ev)
        q.put_nowait(ev)

    def _wait_for_instance(self, f: _Flight, ev: Error) -> bool:
        """A migration that the conductor answered "no live ... instance": send it again
        shortly, until ``migration_wait_s`` after the first such answer, since the only
        instance of a role is restarting (a vLLM engine takes tens of seconds) or another
        is on its way. Whether it was (False: the error goes to the client)."""
        if not (
            f.attempt
            and f.resent is not None
            and ev.code == ErrorCode.UNAVAILABLE
            and ev.message.startswith("no live ")
        ):
            return False
        now = time.monotonic()
        if not f.wait_until:
            f.wait_until = now + self.migration_wait_s
        if now >= f.wait_until:
            return False
        self.migration_waits += 1
        pause = min(max(ev.retry_after_s or 0.0, 0.5), 2.0, f.wait_until - now)
        log.warning(
            "migration_waiting",
            request_id=ev.request_id,
            why=ev.message,
            retry_in_s=round(pause, 2),
            gives_up_in_s=round(f.wait_until - now, 1),
        )
        self._spawn(self._send_again(f, f.resent, pause), f)
        return True

    async def _send_again(self, f: _Flight, req: GenerateRequest, pause: float) -> None:
        await asyncio.sleep(pause)
        old = req.request_id
        rid = self._routes.get(old, "")
        if f.resent is not req or self._flights.get(rid) is not f:
            return  # finished, cancelled or migrated again meanwhile
        # Under a new attempt id: the intake would drop the same id as a duplicate, and
        # the answered one is over (its error placed nothing).
        new = f"{old}-w{self.migration_waits}"
        again = msgspec.structs.replace(req, request_id=new, reply_subject=self.reply_subject(new))
        self._routes.pop(old, None)
        self._nonces.pop(old, None)
        self._routes[new] = rid
        f.current, f.resent = new, again
        self.watchdog.track(rid)  # queued again: only the idle timeout until Accepted
        try:
            await self._dispatch(again)
        except Exception as e:  # noqa: BLE001 - NATS down or closing: the watchdog ends it
            log.warning("migration_resend_failed", request_id=new, error=str(e))

    @staticmethod
    def _lost_before(f: _Flight, ev: StreamEvent) -> bool:
        """A token past the ones the client has, or an end that counts more tokens
        than the client got (each attempt's indices and counts start at its offset;
        with n > 1, each sequence's indices start at 0 and the end counts them all)."""
        if type(ev) is Tokens:
            have = len(f.generated) if ev.seq == 0 else f.seq_counts.get(ev.seq, 0)
            return ev.index + f.offset > have
        if type(ev) is Finished:
            have = len(f.generated) + sum(f.seq_counts.values())
            return ev.completion_tokens + f.offset > have
        return False

    def _note_tokens(self, f: _Flight, ev: Tokens) -> Tokens:
        """Record what the client gets (for a later migration) and shift the index of a
        migrated attempt's tokens to the client's."""
        if ev.seq:  # n > 1 is never migrated: only counted, for the loss check
            f.seq_counts[ev.seq] = max(f.seq_counts.get(ev.seq, 0), ev.index + len(ev.token_ids))
            return ev
        index = ev.index + f.offset
        have = len(f.generated)
        if index <= have:
            f.generated.extend(ev.token_ids[have - index :])
        if f.offset:
            ev = msgspec.structs.replace(ev, index=index)
        return ev

    def _from_attempt(self, f: _Flight, ev: StreamEvent) -> StreamEvent:
        assert f.request is not None  # migrated only after it was sent
        rid, n = f.request.request_id, len(f.request.prompt_token_ids)
        if isinstance(ev, Finished):
            return msgspec.structs.replace(
                ev,
                request_id=rid,
                prompt_tokens=n,
                completion_tokens=ev.completion_tokens + f.offset,
                cached_tokens=min(ev.cached_tokens, n),
            )
        if isinstance(ev, Error):
            return msgspec.structs.replace(
                ev, request_id=rid, message=f"{ev.message} (after {f.attempt} migration(s))"
            )
        return ev

    async def _on_load(self, msg: NatsMsg) -> None:
        # perigee.load.<role>.<instance>: the subject names the instance, the report its
        # incarnation (and a decode instance's step time, for the progress watchdog).
        parts = msg.subject.split(".", 3)
        if len(parts) == 4 and parts[3]:
            try:
                hb = _heartbeat.decode(msg.data)
            except msgspec.DecodeError:
                hb = _Heartbeat()
            if hb.node:
                self.nodes[parts[3]] = hb.node
            if self.watchdog.seen(parts[3], hb.incarnation, hb.step_time_s):
                metrics.INSTANCE_RESTARTS.inc()
                log.warning("instance_restarted", instance=parts[3], incarnation=hb.incarnation)
                self.sweep()  # a new incarnation: the old one's requests go on elsewhere now
            self.roles[parts[3]] = parts[2]

    async def _on_echo(self, msg: NatsMsg) -> None:
        now = time.monotonic()
        try:
            self._echo_lag = now - float(msg.data)
        except ValueError:
            return
        self._echo_rx = now

    def input_fresh(self, now: float | None = None) -> bool:
        """Whether this gateway reads the bus promptly (its last echo came back in time)."""
        now = time.monotonic() if now is None else now
        limit = max(self.watchdog.dead_after_s / 2, 2.5 * self._sweep_interval)
        return now - self._echo_rx <= limit and self._echo_lag <= limit

    def live_roles(self) -> set[str]:
        """The roles ("prefill", "decode") with at least one instance reporting now."""
        alive = self.watchdog.liveness.alive_instances()
        return {self.roles[i] for i in alive if i in self.roles}

    def missing(self) -> list[str]:
        """What a request needs and nothing answers for now: the bus, an admission and a
        conductor (their presence beats), a prefill and a decode instance (their load
        reports). Empty: a request sent now can be served."""
        if not self.nc.is_connected:
            return ["bus"]
        control = [k for k in presence.KINDS if not self.control.alive(k)]
        live = self.live_roles()
        return control + [r for r in ROLES if r not in live]

    # ---- watchdog ------------------------------------------------------------------
    def sweep(self, judge_liveness: bool = True) -> int:
        """Run the watchdog once; returns how many verdicts it gave (a request whose
        instance died is migrated while ``--migration-limit`` allows, else failed)."""
        wedged = self.watchdog.wedged
        verdicts = self.watchdog.sweep(judge_liveness)
        if judge_liveness:
            gone = self.control.silent()
            if gone:
                self._control_died(gone, "silent")
        if self.watchdog.wedged > wedged:
            metrics.REQUESTS_WEDGED.inc(self.watchdog.wedged - wedged)
        for v in verdicts:
            self._resolve(v)
        return len(verdicts)

    def _resolve(self, v: Verdict) -> None:
        """Migrate (or finish, or fail) the request of a death verdict; fail it on any
        other verdict."""
        f = self._flights.get(v.request_id)
        if f is None:
            return
        message = v.message
        if (
            f.request is not None
            and f.request.sampling.n > 1
            and v.dead_role
            and (f.generated or f.seq_counts)
        ):
            # n sequences are not resumed once the client has tokens (each would need
            # its own prompt + answer so far): the request fails, none of its sequences
            # cut short silently. Before any token it is simply sent again, as n = 1 is.
            message = f"{message}; a request with n > 1 is not migrated, send it again"
            f.queue.put_nowait(LocalError(request_id=v.request_id, code=v.code, message=message))
            return
        if (v.dead_instance or v.dead_role in (BUS_LOSS, resend.STORE)) and f.request is not None:
            pause = self._store_pause(f) if v.dead_role == resend.STORE else 0.0
            d = resend.plan(
                f.request,
                f.generated,
                attempts=f.attempt,
                # A resume after a bus loss is no worker's death: not counted.
                limit=(
                    f.attempt + 1
                    if v.dead_role == BUS_LOSS
                    else self.migration_limit + f.bus_resumes + f.store_retries
                ),
                dead_role=v.dead_role,
                dead_instance=v.dead_instance,
                reply_subject=self.reply_subject(resend.attempt_id(v.request_id, f.attempt + 1)),
                eos_token_ids=self.eos_token_ids,
                dead_incarnation=v.dead_incarnation,
                wedged=v.wedged,
                failure=v.message if v.dead_role == resend.STORE else "",
            )
            if isinstance(d, resend.Resume):
                f.bus_resumes += v.dead_role == BUS_LOSS
                self._migrate(f, d, v, pause)
                return
            if isinstance(d, resend.Finish):
                self._spawn(self.cancel(f.current, f"{v.dead_role} instance died", v.placement), f)
                f.queue.put_nowait(
                    Finished(
                        request_id=v.request_id,
                        finish_reason=d.finish_reason,
                        prompt_tokens=len(f.request.prompt_token_ids),
                        completion_tokens=len(f.generated),
                        cached_tokens=0,
                    )
                )
                return
            message = d.message
        f.queue.put_nowait(LocalError(request_id=v.request_id, code=v.code, message=message))

    async def _on_bus_reconnected(self, msg: NatsMsg) -> None:
        """A client of a NATS server that died is connected again: what was in flight to
        or from it is lost (core NATS is at most once), and the requests waiting on it
        would wait until their timeout. So those requests go on from the tokens their
        client has, as after a worker's death: only the ones the sender could have
        dropped, judged by who it is (the subject names it, and the bus lets a login
        publish only its own: perigee.natsauth):

            this gateway           every request it has in flight
            worker <instance>      the requests placed on that instance
            store <node>           the requests placed on instances of that node
            admission, conductor   the requests not placed yet
            anyone else            none

        A request is resumed so at most ``MAX_BUS_RESUMES`` times. Notices are coalesced
        into one pass, ``bus_settle_s`` after the first, so that a request is resent once,
        not once per client. A pass always starts after every notice it answers was
        received, which is all the guarantee needs."""
        parts = msg.subject.split(".")
        kind, sender = (parts[-2], parts[-1]) if len(parts) >= 5 else ("", "")
        if kind not in ("gateway", "worker", "store", "admission", "conductor"):
            return
        if kind == "gateway" and sender != self.gateway_id:
            return  # another gateway's own requests
        self._bus_lost.add(f"{kind}:{sender}")
        self.lateness.disturbed(self.watchdog.clock.now())
        self._resume_pass_soon()

    def _resume_pass_soon(self) -> None:
        """One resume pass for every loss noted until it starts (``bus_settle_s``)."""
        if not self._bus_pass_due:
            self._bus_pass_due = True
            self._spawn(self._resume_after_bus_loss())

    async def _on_presence(self, msg: NatsMsg) -> None:
        try:
            p = _presence.decode(msg.data)
        except msgspec.DecodeError:
            self.bad_events += 1
            return
        if p.kind not in presence.KINDS or msg.subject != subjects.presence(p.kind, p.name):
            log.warning("presence_impostor", subject=msg.subject, kind=p.kind, claimed=p.name)
            return
        dead = self.control.seen(p.kind, p.name, p.incarnation, p.interval_s)
        if dead is not None:
            self._control_died([dead], "restarted")

    def _control_died(self, keys: list[str], how: str) -> None:
        """Admission or conductor processes died: the requests on the core path that are
        not placed yet may have died with them, and are sent again in the next resume
        pass (one pass for every notice within ``bus_settle_s``)."""
        self.control_deaths += len(keys)
        log.warning("control_process_died", processes=sorted(keys), how=how)
        self._control_lost.update(keys)
        self.lateness.disturbed(self.watchdog.clock.now())
        self._resume_pass_soon()

    def _lost_with(self, who: set[str], rid: str) -> bool:
        """Whether request ``rid`` may have lost a message with one of ``who``."""
        if f"gateway:{self.gateway_id}" in who:
            return True
        held = self.watchdog.placement(rid)
        if not held:
            return any(w.startswith(("admission:", "conductor:")) for w in who)
        for inst, _ in held:
            if f"worker:{inst}" in who or f"store:{self.nodes.get(inst, '')}" in who:
                return True
        return False

    async def _resume_after_bus_loss(self) -> None:
        await asyncio.sleep(self.bus_settle_s)
        self._bus_pass_due = False  # a notice from now on gets a pass of its own
        self.bus_passes += 1
        who, self._bus_lost = set(self._bus_lost), set()
        died, self._control_lost = set(self._control_lost), set()
        sent: list[tuple[str, str]] = []
        for rid, f in self._flights.items():
            if f.request is None or f.bus_resumes >= MAX_BUS_RESUMES:
                continue
            if self._lost_with(who, rid):
                why = f"messages lost with a NATS server ({', '.join(sorted(who))} reconnected)"
            elif died and f.on_core and not self.watchdog.placement(rid):
                why = f"not placed when {', '.join(sorted(died))} died"
            else:
                continue
            sent.append((rid, why))
        if sent:
            log.warning(
                "bus_loss_resume", clients=sorted(who), died=sorted(died), requests=len(sent)
            )
        for rid, why in sent:
            self._resolve(
                Verdict(
                    rid,
                    ErrorCode.UNAVAILABLE,
                    why,
                    dead_role=BUS_LOSS,
                    placement=self.watchdog.placement(rid),
                )
            )

    def _store_pause(self, f: _Flight) -> float:
        """A store that failed under a request is usually restarting (a supervisor brings
        it back in seconds) and the next placement may land on it again. Until
        ``migration_wait_s`` after the first such failure, the request is sent again
        after a growing pause and the attempt is not counted against
        ``--migration-limit``; after that, it counts as any migration does."""
        now = time.monotonic()
        if not f.store_wait_until:
            f.store_wait_until = now + self.migration_wait_s
        if now >= f.store_wait_until:
            return 0.0
        f.store_retries += 1
        return min(0.25 * 2 ** (f.store_retries - 1), 2.0, f.store_wait_until - now)

    def _migrate(self, f: _Flight, d: "resend.Resume", v: Verdict, pause: float = 0.0) -> None:
        rid, old, new = v.request_id, f.current, d.request.request_id
        self._routes.pop(old, None)
        self._routes[new] = rid
        f.attempt, f.current, f.offset = d.request.migration.attempt, new, d.offset
        f.resent, f.resend_tries = d.request, 0
        self.migrations += 1
        self.watchdog.track(rid)  # queued again: only the idle timeout until Accepted
        log.warning(
            "migrating",
            request_id=rid,
            attempt=f.attempt,
            dead=v.dead_instance,
            role=v.dead_role,
            resumed_tokens=d.offset,
            why=v.message,
            pause_s=round(pause, 2),
        )

        async def resend() -> None:
            # A wedged instance is alive: the cancel must reach it (a dead one's ends at once).
            self._spawn(
                self.cancel(
                    old, f"migrated: {v.dead_role} instance {v.dead_instance} died", v.placement
                )
            )
            if pause:
                await asyncio.sleep(pause)
                if self._routes.get(new) != rid or self._flights.get(rid) is not f:
                    return  # cancelled or ended meanwhile
            try:
                await self._dispatch(d.request)
            except Exception as e:  # noqa: BLE001 - NATS down or closing
                if self._routes.get(new) == rid:
                    self.watchdog.untrack(rid)
                    f.queue.put_nowait(
                        LocalError(
                            request_id=rid,
                            code=503,
                            cancel=False,
                            message=f"{v.message}; migrating it failed: {e}",
                        )
                    )

        self._spawn(resend(), f)

    async def _resend_later(self, f: _Flight, req: GenerateRequest) -> None:
        f.resend_tries += 1
        self.resends_unanswered += 1
        log.warning("send_no_responders", request_id=req.request_id, tries=f.resend_tries)
        await asyncio.sleep(min(1.0, 0.1 * 2 ** (f.resend_tries - 1)))
        if (
            f.current != req.request_id
            or self._flights.get(self._routes.get(req.request_id, "")) is not f
        ):
            return  # migrated again, finished or cancelled meanwhile
        try:
            await self._dispatch(req)
        except Exception as e:  # noqa: BLE001 - NATS down or closing: the watchdog ends it
            log.warning("migration_resend_failed", request_id=req.request_id, error=str(e))

    def _spawn(self, coro, f: _Flight | None = None) -> None:
        """``coro`` in the background; with ``f``, in its request's context (the sweep's
        and the reply handlers' tasks are in none: a migration sent from them began a
        trace of its own at admission)."""
        ctx = f.ctx.copy() if f is not None and f.ctx is not None else None
        t = asyncio.get_running_loop().create_task(coro, context=ctx)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    async def _sweep_loop(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                fresh = self.input_fresh()
                if not fresh:
                    self.stale_sweeps += 1
                    log.warning(
                        "gateway_input_lagging",
                        echo_lag_s=round(self._echo_lag, 3),
                        since_echo_s=round(time.monotonic() - self._echo_rx, 3),
                    )
                self.sweep(judge_liveness=fresh)
                self.prune()
                with contextlib.suppress(Exception):  # NATS closing: the next round retries
                    await self.nc.publish(self._echo_subject, repr(time.monotonic()).encode())
            except Exception:  # noqa: BLE001 - the sweeper must survive anything
                log.exception("sweep_failed")
