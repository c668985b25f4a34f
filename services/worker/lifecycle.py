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

import msgspec
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg as NatsMsg

from bus_schemas import subjects
from bus_schemas.codec import encode
from bus_schemas.load import WorkerStats
from bus_schemas.placement import RequestFailed
from bus_schemas.requests import CancelAck, CancelRequest, Error, ErrorCode, GenerateRequest
from bus_schemas.roles import Role
from services.common import bus
from services.common.clock import Clock, WallClock
from services.common.incarnation import addressed_elsewhere, process_incarnation
from services.common.kv_errors import restarted_message
from services.common.tasks import cancel_and_wait

log = structlog.get_logger()

REMEMBER_CANCELLED = 10_000


class WorkerBase:
    """What prefill and decode instances share: cancels, stats, load reports and the task gate."""

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
        incarnation: int | None = None,
    ) -> None:
        self.nc = nc
        self.incarnation = process_incarnation() if incarnation is None else incarnation
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
                subjects.conductor_events(conductor_id, self.instance),
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
            await cancel_and_wait([self._reporter])
        if self._stats_sub is not None:
            try:
                await self._stats_sub.unsubscribe()
            except Exception:  # noqa: BLE001 - connection may be gone
                pass

    def remember_cancel(self, request_id: str) -> None:
        self._cancelled[request_id] = None
        while len(self._cancelled) > REMEMBER_CANCELLED:
            self._cancelled.popitem(last=False)

    def cancel_is_mine(self, c: CancelRequest) -> bool:
        """Whether to act on ``c``: not when it names this instance under another
        incarnation (the request was the dead process's; nothing here holds it)."""
        return not addressed_elsewhere(c.targets.get(self.instance, 0), self.incarnation)

    async def ack_cancel(self, c: CancelRequest, msg: NatsMsg | None, held: bool) -> None:
        """Answer a cancel that names this instance, so its sender stops repeating it."""
        if msg is None or not msg.reply or self.instance not in c.targets:
            return
        ack = CancelAck(
            request_id=c.request_id,
            instance=self.instance,
            incarnation=self.incarnation,
            held=held,
            refused=not self.cancel_is_mine(c),
        )
        try:
            await self.nc.publish(msg.reply, encode(ack))
        except Exception as e:  # noqa: BLE001 - the sender repeats it
            log.warning("cancel_ack_failed", request_id=c.request_id, error=str(e))

    async def admit_task(self, task: Any, request_id: str, addressed: int = 0) -> bool:
        """False (and the request failed) when the task was addressed to another
        incarnation of this instance, was cancelled before it came, or this instance is
        shutting down."""
        self._last_task = self.clock.now()
        if addressed_elsewhere(addressed, self.incarnation):
            self.counters["tasks_refused_incarnation"] = (
                self.counters.get("tasks_refused_incarnation", 0) + 1
            )
            log.warning("task_for_another_incarnation", addressed=addressed, mine=self.incarnation)
            await self._fail(task, ErrorCode.UNAVAILABLE, restarted_message(self.instance))
            return False
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
                    report = msgspec.structs.replace(
                        self.load_report(), incarnation=self.incarnation
                    )
                    if self.calibrator is not None:
                        report = self.calibrator.annotate(report)
                    await bus.publish(self.nc, subject, report)
                except Exception as e:  # noqa: BLE001 - keep reporting through reconnects
                    log.warning("load_report_failed", error=str(e))
            await asyncio.sleep(self.report_interval)
