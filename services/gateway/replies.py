"""The gateway's side of the bus: one wildcard subscription demultiplexed into
per-request queues, load reports feeding the watchdog, and its periodic sweep.

Lifecycle of a request's queue:

    open(rid)  -> queue registered, watchdog tracks rid
    events     -> ``perigee.gw.<gateway>.<rid>`` decoded once here, watchdog fed,
                  the event put on the queue (unknown rids are dropped)
    sweep      -> a watchdog verdict puts a local :class:`Error` on the queue
    close(rid) -> queue and watchdog entry removed

No per-request subscription: ``perigee.gw.<gateway>.>`` is subscribed once at start.

The sweep judges liveness from load reports, which reach the gateway through its own
NATS connection. When that input lags (a gateway busy with a thousand streams reads
its socket late), every instance looks silent at once. So each sweep publishes
an echo to ``perigee.gw.<gateway>`` and only gives death verdicts while the echoes come
back within half of ``dead_after_s`` (or 2.5 sweep intervals, if longer).
"""

import asyncio
import contextlib
import time

import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg as NatsMsg

from bus_schemas import subjects
from bus_schemas.codec import BadMessage, decode
from bus_schemas.requests import (
    Accepted,
    CancelRequest,
    Error,
    GenerateRequest,
    StreamEvent,
    Tokens,
)
from services.common.bus import publish
from services.gateway.watchdog import Watchdog

log = structlog.get_logger()


class LocalError(Error, tag="error"):
    """An :class:`Error` the gateway made itself (watchdog, shutdown, no responders);
    ``cancel``: the backend may still be working on the request and must be told."""

    cancel: bool = True


NO_RESPONDERS = "503"  # NATS status header on a reply subject: nobody subscribes the subject


class ReplyRouter:
    def __init__(self, nc: NATS, gateway_id: str, watchdog: Watchdog) -> None:
        self.nc = nc
        self.gateway_id = gateway_id
        self.watchdog = watchdog
        self._prefix = subjects.gateway_reply(gateway_id, "")
        self._queues: dict[str, asyncio.Queue] = {}
        self._subs: list = []
        self._sweeper: asyncio.Task | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self.bad_events = 0
        self.roles: dict[str, str] = {}  # instance -> role, from its load reports
        # Not matched by the replies wildcard (``>`` needs one more token).
        self._echo_subject = self._prefix.rstrip(".")
        self._echo_rx = time.monotonic()  # when the last echo came back
        self._echo_lag = 0.0  # how late it came back
        self.stale_sweeps = 0
        self._sweep_interval = 0.0

    async def start(self, sweep_interval_s: float | None) -> None:
        self._subs.append(await self.nc.subscribe(subjects.gateway_replies(self.gateway_id), cb=self._on_reply))
        self._subs.append(await self.nc.subscribe(subjects.LOAD_ALL, cb=self._on_load))
        self._subs.append(await self.nc.subscribe(self._echo_subject, cb=self._on_echo))
        # nats-py writes flush()'s PING straight to the socket, ahead of a SUB still in
        # its pending buffer: only the second PONG proves the server has the SUBs.
        await self.nc.flush()
        await self.nc.flush()
        if sweep_interval_s:
            self._sweep_interval = sweep_interval_s
            self._echo_rx = time.monotonic()
            self._sweeper = asyncio.create_task(self._sweep_loop(sweep_interval_s), name="gateway.sweep")

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        for s in self._subs:
            with contextlib.suppress(Exception):
                await s.unsubscribe()
        self._subs.clear()

    # ---- per request ---------------------------------------------------------------
    def reply_subject(self, request_id: str) -> str:
        return self._prefix + request_id

    def open(self, request_id: str) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        self._idle.clear()
        self.watchdog.track(request_id)
        return q

    def close_request(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self.watchdog.untrack(request_id)
        if not self._queues:
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
        for rid, q in self._queues.items():
            self.watchdog.untrack(rid)
            q.put_nowait(LocalError(request_id=rid, code=code, message=message))

    @property
    def in_flight(self) -> int:
        return len(self._queues)

    async def send(self, req: GenerateRequest) -> None:
        await publish(self.nc, subjects.REQUESTS, req, reply=req.reply_subject)

    async def cancel(self, request_id: str, reason: str) -> None:
        try:
            await publish(self.nc, subjects.CANCEL, CancelRequest(request_id=request_id, reason=reason))
        except Exception as e:  # noqa: BLE001 - best effort; workers also time out
            log.warning("cancel_publish_failed", request_id=request_id, error=str(e))

    # ---- callbacks -----------------------------------------------------------------
    async def _on_reply(self, msg: NatsMsg) -> None:
        rid = msg.subject[len(self._prefix) :]
        q = self._queues.get(rid)
        if q is None:
            return  # finished, cancelled or timed out already
        if not msg.data and msg.headers and msg.headers.get("Status") == NO_RESPONDERS:
            self.watchdog.untrack(rid)
            q.put_nowait(
                LocalError(
                    request_id=rid, code=503, cancel=False,
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
        wd = self.watchdog
        if type(ev) is Tokens:
            wd.tokens(rid, ev.from_prefill)
        elif type(ev) is Accepted:
            wd.accepted(rid, ev.prefill_instance, ev.decode_instance)
        else:  # Finished / Error: terminal, the watchdog has nothing left to guard
            wd.untrack(rid)
        q.put_nowait(ev)

    async def _on_load(self, msg: NatsMsg) -> None:
        # perigee.load.<role>.<instance>: the subject names the instance; no decode needed.
        parts = msg.subject.split(".", 3)
        if len(parts) == 4 and parts[3]:
            self.watchdog.seen(parts[3])
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

    # ---- watchdog ------------------------------------------------------------------
    def sweep(self, judge_liveness: bool = True) -> int:
        """Run the watchdog once; returns how many requests it failed."""
        verdicts = self.watchdog.sweep(judge_liveness)
        for v in verdicts:
            q = self._queues.get(v.request_id)
            if q is not None:
                q.put_nowait(LocalError(request_id=v.request_id, code=v.code, message=v.message))
        return len(verdicts)

    async def _sweep_loop(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                fresh = self.input_fresh()
                if not fresh:
                    self.stale_sweeps += 1
                    log.warning("gateway_input_lagging", echo_lag_s=round(self._echo_lag, 3),
                                since_echo_s=round(time.monotonic() - self._echo_rx, 3))
                self.sweep(judge_liveness=fresh)
                with contextlib.suppress(Exception):  # NATS closing: the next round retries
                    await self.nc.publish(self._echo_subject, repr(time.monotonic()).encode())
            except Exception:  # noqa: BLE001 - the sweeper must survive anything
                log.exception("sweep_failed")
