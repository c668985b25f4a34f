"""What a prefill and a decode instance share around their own request lifecycle:
the memory of cancelled requests (a cancel may overtake its task on the bus), the
WorkerStats endpoint, the periodic load report (paused while draining for a role
switch) and the gate every arriving task passes first.

A subclass sets ``role`` and implements :meth:`load_report` and :meth:`_fail`; it
calls :meth:`_start_common` from ``start`` and :meth:`_close_common` from ``close``.
"""

import asyncio
from collections import OrderedDict
from typing import Any

import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg as NatsMsg

from bus_schemas import subjects
from bus_schemas.codec import encode
from bus_schemas.load import WorkerStats
from bus_schemas.placement import RequestFailed
from bus_schemas.requests import Error, ErrorCode, GenerateRequest
from bus_schemas.roles import Role
from services.common import bus
from services.common.clock import Clock, WallClock

log = structlog.get_logger()

REMEMBER_CANCELLED = 10_000


class WorkerBase:
    role: Role
    cancelled_counter = "tasks_cancelled"  # counts tasks dropped because of a cancel
    # The instance's services.common.calibrator.Calibrator (set by whoever runs the
    # worker): load reports then carry its fit and fresh measurements.
    calibrator: Any = None

    def __init__(
        self,
        nc: NATS,
        *,
        instance: str,
        node: str,
        report_interval: float,
        clock: Clock | None = None,
    ) -> None:
        self.nc = nc
        self.clock: Clock = clock or WallClock()  # monotonic: durations and quiet periods
        self.instance = instance
        self.node = node
        self.report_interval = report_interval
        self.counters: dict[str, int] = {}
        self.dead = asyncio.Event()  # the engine died: the process should exit
        self.draining = False  # role switch: no load reports, finish what comes
        self._closing = False
        self._last_task = self.clock.now()
        self._cancelled: OrderedDict[str, None] = OrderedDict()
        self._stats_sub: Any = None
        self._reporter: asyncio.Task[None] | None = None

    # -- to implement --
    def load_report(self) -> Any:
        """This instance's PrefillLoad / DecodeLoad now."""
        raise NotImplementedError

    async def _fail(
        self, task: Any, code: ErrorCode, message: str, counter: str = "tasks_failed"
    ) -> None:
        raise NotImplementedError

    async def _report_failure(
        self,
        req: GenerateRequest,
        conductor_id: str,
        prefill_node: str,
        prefill_tx_id: str,
        code: ErrorCode,
        message: str,
        counter: str,
        also: tuple[tuple[str, Any], ...] = (),
    ) -> None:
        """Error to the client, RequestFailed to the placing conductor (it rolls the
        transactions back), then ``also``'s (subject, message) pairs; counted under
        ``counter``. Publishing may fail while shutting down: logged, not raised."""
        self.counters[counter] += 1
        try:
            if req.reply_subject:
                await bus.publish(
                    self.nc,
                    req.reply_subject,
                    Error(request_id=req.request_id, code=code, message=message),
                )
            await bus.publish(
                self.nc,
                subjects.conductor_events(conductor_id),
                RequestFailed(
                    request_id=req.request_id,
                    prefill_node=prefill_node,
                    prefill_tx_id=prefill_tx_id,
                    reason=message,
                ),
            )
            for subject, msg in also:
                await self.nc.publish(subject, encode(msg))
        except Exception as e:  # noqa: BLE001 - the bus may be gone while shutting down
            log.warning("fail_publish_failed", error=str(e))

    def stats_counters(self) -> dict[str, int]:
        # An engine may add its own counters (the vllm engine: tokens vLLM computed,
        # KV loaded/saved by its connector).
        extra: dict[str, int] = getattr(self.engine, "counters_snapshot", dict)()  # type: ignore[attr-defined]
        return {**extra, **self.counters}

    # -- shared lifecycle --
    async def _start_common(self) -> None:
        self._stats_sub = await self.nc.subscribe(
            subjects.worker_stats(self.role, self.instance), cb=self._on_stats
        )
        self._reporter = asyncio.create_task(self._report_loop(), name=f"{self.role}-load-report")

    async def _close_common(self) -> None:
        if self._reporter is not None:
            self._reporter.cancel()
            await asyncio.gather(self._reporter, return_exceptions=True)
        if self._stats_sub is not None:
            try:
                await self._stats_sub.unsubscribe()
            except Exception:  # noqa: BLE001 - connection may be gone
                pass

    def remember_cancel(self, request_id: str) -> None:
        self._cancelled[request_id] = None
        while len(self._cancelled) > REMEMBER_CANCELLED:
            self._cancelled.popitem(last=False)

    async def admit_task(self, task: Any, request_id: str) -> bool:
        """False (and the request failed) when the task was cancelled before it came,
        or this instance is shutting down."""
        self._last_task = self.clock.now()
        if request_id in self._cancelled:
            await self._fail(task, ErrorCode.CANCELLED, "cancelled", counter=self.cancelled_counter)
            return False
        if self._closing:
            await self._fail(task, ErrorCode.UNAVAILABLE, f"{self.role} instance shutting down")
            return False
        return True

    async def _on_stats(self, msg: NatsMsg) -> None:
        if msg.reply:
            stats = WorkerStats(
                instance=self.instance,
                node=self.node,
                role=self.role,
                counters=self.stats_counters(),
            )
            await self.nc.publish(msg.reply, encode(stats))

    async def _report_loop(self) -> None:
        subject = subjects.load_report(self.role, self.instance)
        while not self.dead.is_set():
            if not self.draining:
                try:
                    report = self.load_report()
                    if self.calibrator is not None:
                        report = self.calibrator.annotate(report)
                    await bus.publish(self.nc, subject, report)
                except Exception as e:  # noqa: BLE001 - keep reporting through reconnects
                    log.warning("load_report_failed", error=str(e))
            await asyncio.sleep(self.report_interval)
