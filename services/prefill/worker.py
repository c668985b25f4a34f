"""Prefill instance: turns a placed PrefillTask into KV on the decode node and a
DecodeTask, one request at a time.

Lifecycle of a request on this instance:

    WaitingQueue   FIFO of PrefillTasks (:class:`~services.prefill.queue.PrefillQueue`);
                   a waiting request holds no store slot
      -> Reserving open the transactions (services.prefill.reserve): PREFILL here,
                   DECODE on the decode node, SOURCE on a remote prefix's holder; a
                   store short of room is asked again until it has some; the leases
                   are renewed from here on until the handoff
      -> Computing pull the remote prefix into prefill_tx slots (if placed so);
                   engine.prefill reads the cached prefix KV from the slots and writes
                   the suffix KV layer by layer; after each layer the node's store ships
                   that layer of every block >= decode_tx.hit_blocks into decode_tx's
                   slots, overlapping the later layers
                   the first token goes to the client as soon as it is computed
                   (``stream_first_token``), while the last layers are still on the wire;
                   a request placed on a CPP group (``task.cpp_stages``) is computed by
                   the group's stages first (services.prefill.cpp_pipeline), then the
                   engine writes its KV here unpaced
      -> Handoff   every ship acked -> DecodeTask(first_token, decode_tx) on
                   decode_tasks(instance) and FirstTokenNotice to the conductor (it
                   commits the prefill and source transactions: the slots are free).
                   The instance computes the next request meanwhile: a handoff only
                   waits on the network, so it runs beside the queue (``_handoffs``).

A failure anywhere (or a cancel, or shutdown) aborts what was reserved and sends
Error to the client's reply subject and RequestFailed to the conductor.

Role switch (paper §5.1, ``--switchable``): :meth:`PrefillWorker.drain` stops the load
reports (conductors forget the instance on the RoleSwitch and see no new report),
serves what is queued and whatever still arrives, and returns once idle and quiet.
"""

import asyncio
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg as NatsMsg
from opentelemetry import context as otel_context
from opentelemetry import trace

from bus_schemas import subjects
from bus_schemas.control import TxHandle
from bus_schemas.load import PrefillLoad
from bus_schemas.placement import (
    DecodeTask,
    FirstTokenNotice,
    PrefillTask,
    RemotePrefix,
)
from bus_schemas.requests import CancelRequest, ErrorCode, Tokens
from bus_schemas.roles import Role
from services.common import bus, metrics
from services.common import reservation as plan
from services.common.clock import Clock, UnixClock
from services.common.cost_model import CostModel
from services.common.errors import BadTask
from services.common.hashing import num_blocks
from services.common.kv_errors import KV_RESERVATION_FAILED, KV_TRANSFER_FAILED
from services.common.kv_layout import KVLayout
from services.common.store_tx import LeaseExpired, StoreTx
from services.engine import Engine, EngineDeadError, PrefillJob, SlotKV
from services.engine.base import EngineRequestError
from services.prefill import metrics as prefill_metrics
from services.prefill.cpp_pipeline import (
    DEFAULT_TIMEOUT_S as DEFAULT_STAGE_TIMEOUT_S,
)
from services.prefill.cpp_pipeline import PipelineError, StageServer, run_pipeline
from services.prefill.queue import PrefillQueue, QueuedPrefill
from services.prefill.reserve import Reservation, ReserveError, Reserver, StoreReserver
from services.prefill.reserve_ahead import AheadReplies
from services.store.client.store_client import TransferError
from services.worker import failures
from services.worker.lifecycle import WorkerBase
from services.worker.settings import WorkerSettings
from tracing import tracer

log = structlog.get_logger()

# The decode node's write grant is opened ahead of the ships (a round trip beside the
# compute) only for a compute predicted at least this long: a shorter one is over before
# the grant comes, and its first ship opens the grant itself for one message less.
HEAD_START_MIN_S = 0.002

REMEMBER_TAKEN = 100_000  # request ids: a redelivery comes within seconds


class PrefillStore(Protocol):
    """What this worker needs of services.store.client.store_client.StoreClient."""

    def slot(self, i: int) -> memoryview: ...
    async def ship_layer(
        self,
        src: TxHandle,
        dst: TxHandle,
        layer: int,
        blocks: list[int],
        layer_bytes: int,
        layer_offset: int,
        commit_src: str = "",
    ) -> None: ...
    async def lease(self, src: TxHandle, dst: TxHandle, blocks: list[int]) -> None: ...
    async def pull(self, dst: TxHandle, remote: RemotePrefix) -> None: ...


@dataclass
class _Computed:
    """A prefill whose compute is over; its layer ships may still be on the wire."""

    first: int
    first_ts: float
    ships: list[asyncio.Task]
    ship_span: Any = None  # prefill.ship, opened with the first layer to ship
    lease: "asyncio.Task[None] | None" = None  # the ships' write grant, opened as compute starts
    job: PrefillJob | None = None  # its logprobs, when the request asked (engine-filled)
    committed: bool = False  # the last ship had the store commit the prefill transaction

    async def stop(self) -> None:
        """Cancel what is still on the wire (nothing, once every ship is acked) and
        close the ship span."""
        for s in self.ships:
            s.cancel()
        await asyncio.gather(*self.ships, return_exceptions=True)
        if self.ship_span is not None:
            self.ship_span.end()
            self.ship_span = None


def first_logprobs(job: PrefillJob) -> list | None:
    return None if job.first_logprobs is None else [job.first_logprobs]


def _logprobs_of(job: PrefillJob) -> dict:
    """What the decode side streams with the first token when prefill did not."""
    return {"first_logprobs": job.first_logprobs, "prompt_logprobs": job.prompt_logprobs}


@dataclass
class _Meta:
    ctx: Any  # trace context of the consumer span that received the task
    enqueued_ns: int
    reservation: Reservation | None = None  # once the compute has started
    queued_at: float = 0.0  # worker clock
    reserve_s: float = 0.0  # its own reservation's wait: the control plane's, not the engine's
    busy_at: float = 0.0  # the engine's busy seconds when it was queued
    moved_s: float = 0.0  # its prefix's load and its group's pipeline: data plane, engines


def _ignore_result(task: "asyncio.Task[None]") -> None:
    if not task.cancelled():
        task.exception()


# A prefill's own failures, ahead of the ones every worker shares (services.worker.failures).
FAILURES: tuple[failures.Rule, ...] = (
    (LeaseExpired, ErrorCode.UNAVAILABLE, lambda e: f"{KV_RESERVATION_FAILED}: {e}"),
    (EngineRequestError, ErrorCode.BAD_REQUEST, lambda e: f"the engine refused the request: {e}"),
    (
        PipelineError,
        ErrorCode.UNAVAILABLE,
        lambda e: f"cpp pipeline failed: {getattr(e, 'message', e)}",
    ),
    (ReserveError, ErrorCode.UNAVAILABLE, lambda e: f"{KV_RESERVATION_FAILED}: {e}"),
    (
        (TransferError, TimeoutError, ConnectionError),
        ErrorCode.UNAVAILABLE,
        lambda e: f"{KV_TRANSFER_FAILED}: {e}",
    ),
)


def classify(exc: BaseException) -> tuple[ErrorCode, str]:
    """(code, short client message) for a failed prefill."""
    return failures.classify(exc, "prefill", FAILURES)


class PrefillWorker(WorkerBase):
    """A prefill instance: computes placed requests' KV, ships it to decode, hands them on."""

    role = Role.PREFILL

    def __init__(
        self,
        nc: NATS,
        store: PrefillStore,
        engine: Engine,
        *,
        instance: str,
        node: str,
        layout: KVLayout,
        cost: CostModel,
        clock: Clock | None = None,
        unix_clock: Clock | None = None,
        report_interval: float = 0.1,
        lease_s: float = 10.0,
        reserver: Reserver | None = None,
    ) -> None:
        super().__init__(
            nc, instance=instance, node=node, report_interval=report_interval, clock=clock
        )
        # Timestamps that leave the process (reports, notices, span starts) are Unix time.
        self.unix: Clock = unix_clock or UnixClock()
        self.store = store
        self.engine = engine
        self.reserver = reserver or StoreReserver(StoreTx(nc), lease_s=lease_s, clock=self.clock)
        self.layout = layout
        self.cost = cost
        self.queue: PrefillQueue[QueuedPrefill] = PrefillQueue(cost, self.clock)
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "tasks_done",
                "tasks_failed",
                "tasks_cancelled",
                "computed_tokens",
                "prefix_tokens_loaded",
                "remote_tokens_pulled",
            ),
            0,
        )
        self.ahead = AheadReplies(StoreTx(nc), lease_s=lease_s, counters=self.counters)
        # Request ids of the tasks taken: a placement a conductor sends again from its
        # claim (services.common.intake_queue) is run once.
        self._taken: OrderedDict[str, None] = OrderedDict()
        self._subs = bus.Subscriptions(nc)
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._current: asyncio.Task | None = None
        self._handoffs: dict[str, asyncio.Task] = {}  # computed, KV still shipping
        # Anchored pipelines (task.cpp_stages) run beside the queue: their compute is
        # the stages' chunks (compute_lock), so the next request need not wait for them.
        self._pipelined: dict[str, asyncio.Task] = {}
        self._finishing: set[asyncio.Task] = set()  # their supervisors (settle when done)
        self._stop_reason: dict[str, tuple[ErrorCode, str]] = {}
        self._runner: asyncio.Task | None = None
        # One compute at a time on this instance: a request's prefill or one chunk of a
        # pipeline stage it is a member of (any anchor's), in the order they ask (the
        # lock is fair), so a request placed here meanwhile runs between two chunks.
        self.compute_lock = asyncio.Lock()
        self._engine_busy_s = 0.0  # seconds engine.prefill has run here, in all
        self.stages = StageServer(
            nc, instance, self._model, self.clock, self.counters, self.compute_lock
        )

    def _model(self) -> CostModel:
        return self.calibrator.model() if self.calibrator is not None else self.cost

    # -- lifecycle --
    async def start(self) -> None:
        await self.stages.start()
        await self._subs.serve(
            subjects.prefill_tasks(self.instance),
            PrefillTask,
            self._on_task,
            span_name="prefill.task",
        )
        await self._subs.serve(subjects.CANCEL, CancelRequest, self._on_cancel)
        # Answers to the TxAllocates a conductor sent ahead of a task (raw: the stores
        # answer as to any request, and a reply that is no answer counts as a failure).
        self._subs.adopt(
            await self.nc.subscribe(
                subjects.prefill_reserved(self.instance), cb=self.ahead.on_reply
            )
        )
        await self._start_common()
        self._runner = asyncio.create_task(self._run(), name="prefill-run")
        await bus.sync(self.nc)  # its subscriptions are live on the server from here
        metrics.track_worker(Role.PREFILL, self, lambda: prefill_metrics.sample(self))
        log.info("prefill_started", instance=self.instance, node=self.node)

    async def close(self) -> None:
        """Fail what is queued or running (503) so no accepted request is lost, then stop."""
        self._closing = True
        metrics.untrack_worker(Role.PREFILL, self)
        for item in self.queue.waiting:
            self.queue.remove(item.request_id)
            await self._fail(item.task, ErrorCode.UNAVAILABLE, "prefill instance shutting down")
        running = self.queue.running
        if self._current is not None and running is not None:
            self._stop_reason[running.request_id] = (
                ErrorCode.UNAVAILABLE,
                "prefill instance shutting down",
            )
            self._current.cancel()
            try:
                await asyncio.wait_for(self._idle.wait(), timeout=5)
            except TimeoutError:
                log.warning("prefill_close_timeout")
        for rid, t in [*self._handoffs.items(), *self._pipelined.items()]:
            self._stop_reason[rid] = (ErrorCode.UNAVAILABLE, "prefill instance shutting down")
            t.cancel()
        if self._finishing:
            await asyncio.wait(set(self._finishing), timeout=5)
        if self._runner is not None:
            self._runner.cancel()
            await asyncio.gather(self._runner, return_exceptions=True)
        await self._close_common()
        await self.stages.close()
        await self.reserver.close()
        await self.ahead.close()
        await self._subs.close()

    async def drain(self, quiet_s: float = 0.5, poll_s: float = 0.05) -> None:
        """Before a role switch: stop reporting load, then wait until nothing is queued
        or running and no task has arrived for ``quiet_s`` (late placements still run)."""
        self.draining = True
        while not (
            len(self.queue) == 0
            and self._idle.is_set()
            and not self._handoffs
            and not self._pipelined
            and self.clock.now() - self._last_task >= quiet_s
        ):
            if self.dead.is_set():
                return
            await asyncio.sleep(poll_s)

    # -- bus handlers --
    async def _on_task(self, task: PrefillTask, msg: NatsMsg) -> None:
        rid = task.request.request_id
        with structlog.contextvars.bound_contextvars(request_id=rid):
            if rid in self._taken:
                self.counters["tasks_duplicate"] = self.counters.get("tasks_duplicate", 0) + 1
                log.info("duplicate_task_dropped")
                return
            self._taken[rid] = None
            while len(self._taken) > REMEMBER_TAKEN:
                self._taken.popitem(last=False)
            if not await self.admit_task(task, rid, task.prefill_incarnation):
                return
            try:
                self._validate(task)
                meta = _Meta(
                    otel_context.get_current(),
                    int(self.unix.now() * 1e9),
                    queued_at=self.clock.now(),
                    busy_at=self._engine_busy_s,
                )
                self.queue.push(QueuedPrefill.of(task, self.layout.block_size, meta))
            except BadTask as e:
                log.warning("bad_prefill_task", error=str(e))
                await self._fail(task, *classify(e))
                return
            log.debug("prefill_queued", queue_len=len(self.queue))
            self._wake.set()

    async def _on_cancel(self, c: CancelRequest, msg: NatsMsg) -> None:
        held = self.cancel_is_mine(c) and await self._cancel(c)
        await self.ack_cancel(c, msg, held)

    async def _cancel(self, c: CancelRequest) -> bool:
        """Stop request ``c`` names wherever it is here; whether it was here."""
        rid = c.request_id
        self.remember_cancel(rid)
        item = self.queue.remove(rid)
        if item is not None:
            self._end_queue_span(item)
            await self._fail(
                item.task, ErrorCode.CANCELLED, f"cancelled: {c.reason}", counter="tasks_cancelled"
            )
            return True
        running = self.queue.running
        if running is not None and running.request_id == rid and self._current is not None:
            self._stop_reason[rid] = (ErrorCode.CANCELLED, f"cancelled: {c.reason}")
            self._current.cancel()
        elif (t := self._pipelined.get(rid)) is not None:
            self._stop_reason[rid] = (ErrorCode.CANCELLED, f"cancelled: {c.reason}")
            t.cancel()
        elif (handoff := self._handoffs.get(rid)) is not None:
            self._stop_reason[rid] = (ErrorCode.CANCELLED, f"cancelled: {c.reason}")
            handoff.cancel()
        else:
            return False
        return True

    # -- the queue runner --
    async def _run(self) -> None:
        while True:
            item = self.queue.pop()
            if item is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            self._idle.clear()
            rid = item.request_id
            if item.task.cpp_stages:
                self.queue.done(rid)
                self._end_queue_span(item)
                sup = asyncio.create_task(self._pipeline(item), name=f"prefill-cpp:{rid}")
                self._finishing.add(sup)
                sup.add_done_callback(self._finishing.discard)
                self._idle.set()
                continue
            try:
                self._end_queue_span(item)
                self._current = asyncio.create_task(self._process(item), name=f"prefill:{rid}")
                await asyncio.wait({self._current})
                task, self._current = self._current, None
                self.queue.done(rid)
                if not task.cancelled() and task.exception() is None:
                    done = task.result()
                    if rid not in self._stop_reason:
                        sup = asyncio.create_task(
                            self._finish(item, done), name=f"prefill-handoff:{rid}"
                        )
                        self._finishing.add(sup)
                        sup.add_done_callback(self._finishing.discard)
                        continue
                    await done.stop()  # cancelled as compute ended: no handoff
                with structlog.contextvars.bound_contextvars(request_id=rid):
                    await self._settle(item, task)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a bug here must not stop the queue
                log.exception("prefill_runner_error", request_id=rid)
                self.queue.done(rid)
            finally:
                self._idle.set()

    async def _pipeline(self, item: QueuedPrefill) -> None:
        """Run an anchored pipeline beside the queue, then hand it off or settle it as
        the runner does a request of its own."""
        rid = item.request_id
        task = asyncio.create_task(self._process(item), name=f"prefill:{rid}")
        self._pipelined[rid] = task
        try:
            await asyncio.wait({task})
        finally:
            self._pipelined.pop(rid, None)
        with structlog.contextvars.bound_contextvars(request_id=rid):
            try:
                if not task.cancelled() and task.exception() is None:
                    done = task.result()
                    if rid not in self._stop_reason:
                        await self._finish(item, done)
                        return
                    await done.stop()
                await self._settle(item, task)
            except Exception:  # noqa: BLE001 - a bug here must not go unnoticed
                log.exception("prefill_pipeline_settle_error")

    async def _settle(self, item: QueuedPrefill, task: asyncio.Task) -> None:
        stop = self._stop_reason.pop(item.request_id, None)
        res = item.meta.reservation
        if task.cancelled() or stop is not None:
            code, message = stop or (ErrorCode.UNAVAILABLE, "prefill interrupted")
            counter = "tasks_cancelled" if code == ErrorCode.CANCELLED else "tasks_failed"
            await self._fail(item.task, code, message, counter=counter, reservation=res)
            return
        exc = task.exception()
        if exc is None:
            self.counters["tasks_done"] += 1
            return
        code, message = classify(exc)
        log.warning("prefill_failed", error=f"{type(exc).__name__}: {exc}", code=int(code))
        await self._fail(item.task, code, message, reservation=res)
        if isinstance(exc, EngineDeadError):
            self.dead.set()

    async def _in_request(self, item: QueuedPrefill, work: Any) -> Any:
        """Await ``work`` in the request's trace context, its id bound for the logs."""
        token = otel_context.attach(item.meta.ctx)
        try:
            with structlog.contextvars.bound_contextvars(request_id=item.request_id):
                return await work
        finally:
            otel_context.detach(token)

    async def _process(self, item: QueuedPrefill) -> "_Computed":
        return await self._in_request(item, self._prefill(item))

    async def _finish(self, item: QueuedPrefill, done: "_Computed") -> None:
        """Supervise one handoff: wait for it (or its cancellation), then settle."""
        rid = item.request_id
        task = asyncio.create_task(
            self._in_request(item, self._handoff(item, done)), name=f"prefill-ship:{rid}"
        )
        self._handoffs[rid] = task
        try:
            await asyncio.wait({task})
        finally:
            self._handoffs.pop(rid, None)
        with structlog.contextvars.bound_contextvars(request_id=rid):
            try:
                await self._settle(item, task)
            except Exception:  # noqa: BLE001 - a bug here must not go unnoticed
                log.exception("prefill_settle_error")

    async def _reserve(self, item: QueuedPrefill) -> Reservation:
        """Open the request's transactions now that its compute starts."""
        task = item.task
        t0 = self.clock.now()
        with tracer().start_as_current_span("prefill.reserve") as span:
            ahead = None
            if task.reserved_ahead:
                span.set_attribute("ahead", True)
                ahead = self.ahead.take(
                    task.reserved_ahead, task.request.request_id, plan.wanted(task.source)
                )
            res = await self.reserver.reserve(task, ahead=ahead)
        item.meta.reservation = res
        item.meta.reserve_s = self.clock.now() - t0
        self._check_reservation(item.task, res)
        item.settle(res.grant, self.layout.block_size)
        self.queue.reprice_running()
        return res

    async def _prefill(self, item: QueuedPrefill) -> "_Computed":
        task, req = item.task, item.task.request
        res = await self._reserve(item)
        n, p = item.prompt_tokens, item.prefix_tokens
        r = res.remote
        if r is not None and r.num_blocks > 0:
            with tracer().start_as_current_span(
                "prefill.load_prefix",
                attributes={"source_node": r.source_node, "blocks": r.num_blocks},
            ):
                t0 = self.clock.now()
                await self.store.pull(res.prefill_tx, r)
                item.meta.moved_s += self.clock.now() - t0
            self.counters["remote_tokens_pulled"] += item.pulled_tokens
        await self.store.attached(res.prefill_tx)  # its store may have restarted
        slots = [self.store.slot(s) for s in res.prefill_tx.slots]
        kv = SlotKV(self.layout, slots, n)
        blocks = [b for b in range(len(slots)) if b >= res.decode_tx.hit_blocks]
        ships: list[asyncio.Task] = []
        done = _Computed(first=0, first_ts=0.0, ships=ships)
        if blocks and self._model().prefill_time(n, p) >= HEAD_START_MIN_S:
            # The store opens the decode node's write grant for these ships while the
            # layers compute, instead of on the first ship. Only a head start: should it
            # fail, the first ship opens it again and reports why.
            done.lease = asyncio.create_task(
                self.store.lease(res.prefill_tx, res.decode_tx, blocks)
            )
            done.lease.add_done_callback(_ignore_result)
        ready: list[int] = []  # computed layers not yet handed to the store
        last_layer = self.layout.spec.num_layers - 1
        # Set once the first token is out (or, when decode sends it, once computed).
        token_out = asyncio.Event()

        async def pump() -> None:
            # Layers are contiguous inside a block, so a run of finished layers ships as
            # one span: while one ship is on the wire the next layers queue up behind it,
            # and a link slower than compute gets fewer, larger transfers.
            await asyncio.sleep(0)  # let layers that finish in the same tick join this run
            while ready:
                if ready[-1] == last_layer and not token_out.is_set():
                    # The compute is over: the client's first token goes out before this
                    # run's ship (a write to the store that would delay it), and decode,
                    # which waits for every layer anyway, waits only that much longer.
                    await token_out.wait()
                first, last = ready[0], ready[0]
                while len(ready) > last - first + 1 and ready[last - first + 1] == last + 1:
                    last += 1
                del ready[: last - first + 1]
                start, _ = self.layout.layer_span(first)
                _, end = self.layout.layer_span(last)
                # The store's ship (and its write on the decode node) join prefill.ship:
                # the client puts the current context in the ZeroMQ request header.
                # The last layers' ship is the prefill transaction's last read: its
                # store commits it then (no TxCommit from the conductor, no wake more).
                final = last == last_layer
                with trace.use_span(done.ship_span, end_on_exit=False):
                    await self.store.ship_layer(
                        res.prefill_tx,
                        res.decode_tx,
                        first,
                        blocks,
                        end - start,
                        start,
                        commit_src=req.request_id if final else "",
                    )
                if final:
                    done.committed = True
                    self.reserver.prefill_committed(res)

        async def on_layer(layer: int) -> None:
            for s in ships:  # fail fast: a dead peer stops the compute too
                if s.done() and not s.cancelled() and s.exception() is not None:
                    raise s.exception()
            if not blocks:
                return
            if done.ship_span is None:
                done.ship_span = tracer().start_span(
                    "prefill.ship",
                    context=item.meta.ctx,
                    attributes={"blocks": len(blocks), "decode_node": res.decode_tx.node},
                )
            ready.append(layer)
            if not ships or ships[-1].done():
                ships.append(asyncio.create_task(pump()))

        job = PrefillJob(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            prefix_tokens=p,
            sampling=req.sampling,
            kv=kv,
            on_layer=on_layer,
        )
        try:
            if task.cpp_stages:
                # The group computes it as a pipeline; the engine then only writes the
                # KV here, unpaced (and the compute is no sample of this instance's).
                t0 = self.clock.now()
                with tracer().start_as_current_span(
                    "prefill.cpp_pipeline", attributes={"stages": len(task.cpp_stages)}
                ):
                    await run_pipeline(
                        self.nc,
                        req.request_id,
                        list(task.cpp_stages),
                        n,
                        p,
                        task.cpp_chunk_tokens,
                        expected_s=self._model().prefill_time(n, p),
                        # a stage may wait for its member's queue first: the estimate
                        timeout_s=DEFAULT_STAGE_TIMEOUT_S + task.est_ttft_s,
                    )
                job.paced = False
                item.meta.moved_s += self.clock.now() - t0
            with tracer().start_as_current_span(
                "prefill.compute",
                attributes={"prompt_tokens": n, "prefix_tokens": p},
            ):
                async with self.compute_lock:
                    # The engine writes into the prefill tx's slots: only while the
                    # store keeps them (a lease lost meanwhile fails the request).
                    try:
                        done.first, learn = await self.reserver.computing(
                            res, self._compute(job, n, p, measured=not task.cpp_stages)
                        )
                    except LeaseExpired:
                        self.engine.abort(req.request_id)
                        raise
            done.first_ts = self.unix.now()
            done.job = job
            if task.stream_first_token and req.reply_subject:
                # The client need not wait for the KV to land on the decode node.
                with tracer().start_as_current_span("prefill.first_token"):
                    await bus.publish(
                        self.nc,
                        req.reply_subject,
                        Tokens(
                            request_id=req.request_id,
                            token_ids=[done.first],
                            index=0,
                            from_prefill=True,
                            incarnation=self.incarnation,
                            logprobs=first_logprobs(job),
                            prompt_logprobs=job.prompt_logprobs,
                            engine_s=self._engine_s(item),
                        ),
                    )
                await bus.flush_soon()  # out before the last layer's ship and the refit
            token_out.set()
            if learn is not None:  # after the first token: a refit is not on its path
                learn()
        except BaseException:
            await done.stop()
            raise
        self.counters["computed_tokens"] += n - p
        self.counters["prefix_tokens_loaded"] += p
        return done

    async def _handoff(self, item: QueuedPrefill, done: "_Computed") -> None:
        task, req, p = item.task, item.task.request, item.prefix_tokens
        res = item.meta.reservation
        assert res is not None  # _prefill reserved before computing
        first, first_ts = done.first, done.first_ts
        try:
            if done.ships:
                await asyncio.gather(*done.ships)
        finally:
            await done.stop()
        await bus.publish(
            self.nc,
            subjects.decode_tasks(task.decode_instance),
            DecodeTask(
                request=req,
                conductor_id=task.conductor_id,
                prefill_instance=self.instance,
                prefill_node=self.node,
                prefill_tx_id=res.prefill_tx.tx_id,
                decode_tx=res.decode_tx,
                first_token=first,
                cached_tokens=p,
                prefill_done_ts=self.unix.now(),
                first_token_sent=task.stream_first_token,
                decode_incarnation=task.decode_incarnation,
                **({} if task.stream_first_token or done.job is None else _logprobs_of(done.job)),
            ),
        )
        # Every layer is acked, so the prefill-side slots are no longer read: commit.
        src = res.remote
        await bus.publish(
            self.nc,
            subjects.conductor_events(task.conductor_id, self.instance),
            FirstTokenNotice(
                request_id=req.request_id,
                prefill_node=self.node,
                prefill_tx_id=res.prefill_tx.tx_id,
                ts=first_ts,
                handoff_ts=self.unix.now(),
                prefill_committed=done.committed,
                source_node=src.source_node if src else "",
                source_tx_id=src.source_tx.tx_id if src else "",
            ),
        )
        await self.reserver.hand_off(task, res)
        log.debug(
            "prefill_done",
            prefix_tokens=p,
            computed_tokens=item.prompt_tokens - p,
            first_token=first,
        )

    # -- helpers --
    async def _compute(
        self, job: PrefillJob, n: int, p: int, measured: bool = True
    ) -> tuple[int, Any]:
        """``engine.prefill``, measured for this instance's calibration: (first token,
        what to learn once the first token is out: the fit before the compute is the
        prediction; the queue is repriced with the fit after it). A pipeline's last
        write (``measured=False``) is no sample of this instance's compute."""
        calib = self.calibrator
        predicted = calib.model().prefill_time(n, p) if calib is not None and measured else 0.0
        t0 = self.clock.now()
        try:
            first = await self.engine.prefill(job)
        finally:
            seconds = self.clock.now() - t0
            self._engine_busy_s += seconds
        if calib is None or not measured:
            return first, None

        def learn() -> None:
            calib.prefill(n, p, seconds, predicted)
            self.queue.reprice(calib.model())

        return first, learn

    def _engine_s(self, item: QueuedPrefill) -> float:
        """The seconds since the task arrived that this instance's engine accounts for:
        the engine's compute meanwhile (its own, and that of the requests ahead of it),
        its prefix's load and its group's pipeline. Not the event loop's turns between
        them, nor any reservation's wait: a busy control plane makes those."""
        m = item.meta
        engine = self._engine_busy_s - m.busy_at + m.moved_s
        return max(0.0, min(engine, self.clock.now() - m.queued_at - m.reserve_s))

    def _validate(self, task: PrefillTask) -> None:
        req, bs = task.request, self.layout.block_size
        if not req.prompt_token_ids:
            raise BadTask("empty prompt")
        if task.prefill_node != self.node:
            raise BadTask(f"placed for node {task.prefill_node}, this instance is on {self.node}")
        if req.block_size not in (0, bs):
            raise BadTask(f"request block size {req.block_size}, instance uses {bs}")
        if task.cpp_stages and (self.instance not in task.cpp_stages or task.cpp_chunk_tokens < 1):
            raise BadTask(f"pipeline {task.cpp_stages} (chunks of {task.cpp_chunk_tokens})")

    def _check_reservation(self, task: PrefillTask, res: Reservation) -> None:
        n, bs = len(task.request.prompt_token_ids), self.layout.block_size
        if res.prefill_tx.node != self.node:
            raise BadTask(f"prefill tx is on node {res.prefill_tx.node}, not {self.node}")
        r = res.remote
        if r is not None and r.first_block > res.prefill_tx.hit_blocks:
            raise BadTask(
                f"remote prefix starts at block {r.first_block} but only "
                f"{res.prefill_tx.hit_blocks} blocks are local"
            )
        for name, tx in ((Role.PREFILL, res.prefill_tx), (Role.DECODE, res.decode_tx)):
            if tx.block_bytes != self.layout.block_bytes:
                raise BadTask(
                    f"{name} tx blocks are {tx.block_bytes} bytes, "
                    f"the model needs {self.layout.block_bytes}"
                )
            if len(tx.slots) != num_blocks(n, bs):
                raise BadTask(f"{name} tx has {len(tx.slots)} slots for {n} tokens")

    def _end_queue_span(self, item: QueuedPrefill) -> None:
        span = tracer().start_span(
            "prefill.queue", context=item.meta.ctx, start_time=item.meta.enqueued_ns
        )
        span.end()

    async def _fail(
        self,
        task: PrefillTask,
        code: ErrorCode,
        message: str,
        counter: str = "tasks_failed",
        reservation: Reservation | None = None,
    ) -> None:
        if reservation is None and task.reserved_ahead:
            self.ahead.drop(task.reserved_ahead, message)  # what arrived ahead, if any
        if reservation is not None:
            try:
                await self.reserver.release(task, reservation, message)
            except Exception as e:  # noqa: BLE001 - the leases end the slots anyway
                log.warning("release_failed", error=f"{type(e).__name__}: {e}")
        await self._report_failure(
            task.request,
            task.conductor_id,
            self.node,
            reservation.prefill_tx.tx_id if reservation else "",
            code,
            message,
            counter,
        )

    def load_report(self) -> PrefillLoad:
        qlen, qtokens, work = self.queue.load()
        return PrefillLoad(
            instance=self.instance,
            node=self.node,
            queue_len=qlen,
            queued_tokens=qtokens,
            queued_work_s=work + self.stages.busy_s(),
            ts=self.unix.now(),
        )


def build_prefill(nc: NATS, store: Any, engine: Any, s: WorkerSettings) -> PrefillWorker:
    """A prefill worker from the worker settings (``WorkerSettings.builders``' prefill)."""
    return PrefillWorker(
        nc,
        store,
        engine,
        instance=s.instance,
        node=s.node,
        layout=s.layout,
        cost=s.cost,
        report_interval=s.report_interval,
        lease_s=s.lease_s,
        reserver=s.reserver,
    )
