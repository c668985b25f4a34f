"""The prefill instance's FIFO of placed tasks and the load it reports. Pure: no I/O,
time from an injected clock, so the simulator can drive the same queue.

    waiting (FIFO) --pop()--> running (one at a time) --done()--> gone
                              (start_with(): the prefix the store reservation found)
          \\--remove() (cancelled, shutting down)
"""

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from bus_schemas.placement import PrefillTask
from services.common import reservation as plan
from services.common.clock import Clock
from services.common.cost_model import CostModel


class BadTask(ValueError):
    """A task this instance cannot run as placed (wrong node, inconsistent blocks)."""


def prefix_blocks(task: PrefillTask) -> int:
    """Leading blocks the conductor expects on this node before compute (the store
    reservation at compute start has the last word: :meth:`PrefillQueue.start_with`)."""
    try:
        return plan.expected_prefix_blocks(task.expected_hit_blocks, task.source)
    except plan.BadPrefix as e:
        raise BadTask(str(e)) from e


def prefix_tokens(task: PrefillTask, block_size: int) -> int:
    return plan.prefix_tokens(len(task.request.prompt_token_ids), prefix_blocks(task), block_size)


@dataclass
class QueuedPrefill:
    task: PrefillTask
    prompt_tokens: int
    prefix_tokens: int
    work_s: float  # cost-model seconds of compute
    enqueued_at: float
    started_at: float | None = None
    meta: Any = None  # the adapter's per-task baggage (trace context, timestamps)

    @property
    def request_id(self) -> str:
        return self.task.request.request_id

    @property
    def new_tokens(self) -> int:
        return self.prompt_tokens - self.prefix_tokens


class PrefillQueue:
    def __init__(self, cost: CostModel, clock: Clock, block_size: int) -> None:
        self.cost = cost
        self.clock = clock
        self.block_size = block_size
        self._waiting: OrderedDict[str, QueuedPrefill] = OrderedDict()
        self.running: QueuedPrefill | None = None

    def __len__(self) -> int:
        return len(self._waiting) + (self.running is not None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waiting or (
            self.running is not None and self.running.request_id == request_id
        )

    @property
    def waiting(self) -> list[QueuedPrefill]:
        return list(self._waiting.values())

    def push(self, task: PrefillTask, meta: Any = None) -> QueuedPrefill:
        """Queue ``task``; :class:`BadTask` if its request id is already here or its
        remote prefix does not continue the local one."""
        rid = task.request.request_id
        if rid in self:
            raise BadTask(f"request {rid} is already queued on this instance")
        n = len(task.request.prompt_token_ids)
        p = prefix_tokens(task, self.block_size)
        item = QueuedPrefill(
            task=task,
            prompt_tokens=n,
            prefix_tokens=p,
            work_s=self.cost.prefill_time(n, p),
            enqueued_at=self.clock.now(),
            meta=meta,
        )
        self._waiting[rid] = item
        return item

    def reprice(self, cost: CostModel) -> None:
        """Price queued work with ``cost`` from now on, what is already queued included
        (the instance's calibration moved)."""
        self.cost = cost
        items = list(self._waiting.values()) + ([self.running] if self.running else [])
        for i in items:
            i.work_s = cost.prefill_time(i.prompt_tokens, i.prefix_tokens)

    def pop(self) -> QueuedPrefill | None:
        """Start the oldest waiting task (only when none is running)."""
        if self.running is not None or not self._waiting:
            return None
        _, item = self._waiting.popitem(last=False)
        item.started_at = self.clock.now()
        self.running = item
        return item

    def start_with(self, item: QueuedPrefill, prefix_blocks: int) -> None:
        """The running ``item``'s store reservation found ``prefix_blocks`` on this node
        (the expectation may have been off): its remaining work follows the real prefix."""
        n = item.prompt_tokens
        item.prefix_tokens = plan.prefix_tokens(n, prefix_blocks, self.block_size)
        item.work_s = self.cost.prefill_time(n, item.prefix_tokens)

    def done(self, request_id: str) -> None:
        if self.running is not None and self.running.request_id == request_id:
            self.running = None

    def remove(self, request_id: str) -> QueuedPrefill | None:
        """Take a waiting task out (cancelled); the running one is not touched."""
        return self._waiting.pop(request_id, None)

    def load(self) -> tuple[int, int, float]:
        """(queue_len, queued_tokens, queued_work_s), the running task included with its
        remaining cost-model time."""
        tokens = sum(i.new_tokens for i in self._waiting.values())
        work = sum(i.work_s for i in self._waiting.values())
        r = self.running
        if r is not None:
            tokens += r.new_tokens
            elapsed = self.clock.now() - (r.started_at or 0.0)
            work += max(0.0, r.work_s - elapsed)
        return len(self), tokens, work
