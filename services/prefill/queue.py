"""The prefill instance's FIFO of placed work and the load it reports: the one queue that
the live worker (``services/prefill/worker.py``) and the simulator
(``perigee/sim/instances.py``) both drive. Pure: no I/O, time from an injected clock.

    waiting (FIFO) --pop()--> running (one at a time) --done()--> gone
          \\--remove() (cancelled, shutting down)
    running: reprice_running() once its reservation has found the real prefix (its
             compute starts now); runs_until(t) when the adapter knows when it ends
             (the simulator schedules it)

It queues anything shaped like :class:`QueueItem`: the live worker's
:class:`QueuedPrefill` (a bus ``PrefillTask`` and its expected prefix), the simulator's
requests, and its pipelined requests' stage tasks (``perigee.sim.pipeline_gang.StageTask``).

One pricing rule (:func:`price`), the one the conductor books a placement with
(``transfer_s + prefill_s``, services/conductor/placement_policy.py), so that the load report
which covers a dispatch replaces it with the same number:

    a request         transfer_time(pulled_tokens) + prefill of tokens [min(prefix, n-1), n)
                      in chunks of ``chunk_tokens`` (0: one chunk). The instance pulls the
                      remote prefix into its own slots before computing, so the pull
                      holds it as the compute does.
    a pipeline stage  ``stage_work_s``: the member's share as the conductor's pipeline
                      timing booked it (services.policy.chunk_timing.member_work).

The running item counts until its end: its start plus its price, or what
:meth:`PrefillQueue.runs_until` said.
"""

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from bus_schemas.placement import PrefillTask
from services.common import reservation as plan
from services.common.clock import Clock
from services.common.cost_model import CostModel
from services.common.errors import BadTask


class QueueItem(Protocol):
    """What :class:`PrefillQueue` reads of what it queues."""

    @property
    def request_id(self) -> str: ...

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def prefix_tokens(self) -> int:
        """Prompt tokens whose KV is on the node before compute (local hit + pulled)."""
        ...

    @property
    def pulled_tokens(self) -> int:
        """Of those, the ones pulled from another node's store first."""
        ...

    @property
    def stage_work_s(self) -> float | None:
        """A pipeline stage's booked share (None: a whole request, priced here)."""
        ...


T = TypeVar("T", bound=QueueItem)


def computed_prefix(n: int, prefix: int) -> int:
    """The reused prefix of an ``n``-token prompt: the last token is always computed (its
    logits give the first token)."""
    return min(prefix, max(n - 1, 0))


def computed_tokens(item: QueueItem) -> int:
    n = item.prompt_tokens
    return n - computed_prefix(n, item.prefix_tokens)


def chunked_prefill_time(cost: CostModel, n: int, prefix: int, chunk: int) -> float:
    """GPU seconds to compute tokens [prefix, n) in chunks of ``chunk`` (0: one chunk)."""
    if prefix >= n:
        return 0.0
    if chunk <= 0:
        return cost.prefill_time(n, prefix)
    total, a = 0.0, prefix
    while a < n:
        b = min(n, a + chunk)
        total += cost.prefill_time(b, a)
        a = b
    return total


def compute_time(cost: CostModel, item: QueueItem, chunk_tokens: int = 0) -> float:
    """Compute seconds of a whole request: its uncached suffix, chunked."""
    n = item.prompt_tokens
    return chunked_prefill_time(cost, n, computed_prefix(n, item.prefix_tokens), chunk_tokens)


def price(cost: CostModel, item: QueueItem, chunk_tokens: int = 0) -> float:
    """Seconds ``item`` holds the instance once it starts (the module's pricing rule)."""
    if item.stage_work_s is not None:
        return item.stage_work_s
    return compute_time(cost, item, chunk_tokens) + cost.transfer_time(item.pulled_tokens)


@dataclass
class _Entry(Generic[T]):
    item: T
    work_s: float
    tokens: int  # computed tokens as queued
    started_at: float = 0.0
    ends_at: float = 0.0


class PrefillQueue(Generic[T]):
    """A prefill instance's FIFO of placed work, and the load it reports."""

    def __init__(self, cost: CostModel, clock: Clock, *, chunk_tokens: int = 0) -> None:
        self.cost = cost
        self.clock = clock
        self.chunk_tokens = chunk_tokens
        self._waiting: OrderedDict[str, _Entry[T]] = OrderedDict()
        self._running: _Entry[T] | None = None
        # Sums over the waiting entries, kept as they come and go (the simulator asks
        # for the load before every decision).
        self._work = 0.0
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._waiting) + (self._running is not None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waiting or (
            self._running is not None and self._running.item.request_id == request_id
        )

    @property
    def waiting(self) -> list[T]:
        return [e.item for e in self._waiting.values()]

    @property
    def running(self) -> T | None:
        return self._running.item if self._running is not None else None

    def price(self, item: QueueItem) -> float:
        return price(self.cost, item, self.chunk_tokens)

    def work_s(self, request_id: str) -> float:
        """What the queued or running ``request_id`` was priced at."""
        r = self._running
        e = r if r is not None and r.item.request_id == request_id else self._waiting[request_id]
        return e.work_s

    def push(self, item: T) -> None:
        """Queue ``item``; :class:`BadTask` if its request id is already here."""
        rid = item.request_id
        if rid in self:
            raise BadTask(f"request {rid} is already queued on this instance")
        e = _Entry(item, self.price(item), computed_tokens(item))
        self._waiting[rid] = e
        self._work += e.work_s
        self._tokens += e.tokens

    def pop(self) -> T | None:
        """Start the oldest waiting item (only when none is running)."""
        if self._running is not None:
            return None
        if not self._waiting:
            self._work = 0.0  # drop float residue
            return None
        _, e = self._waiting.popitem(last=False)
        self._work -= e.work_s
        self._tokens -= e.tokens
        e.started_at = self.clock.now()
        e.ends_at = e.started_at + e.work_s
        self._running = e
        return e.item

    def reprice_running(self) -> None:
        """The running item's reservation has settled its prefix (and pull): its compute
        starts now, priced again."""
        e = self._running
        if e is None:
            return
        e.work_s = self.price(e.item)
        e.started_at = self.clock.now()
        e.ends_at = e.started_at + e.work_s

    def running_ends_at(self) -> float:
        """When the running item's work ends (0.0: none running)."""
        return self._running.ends_at if self._running is not None else 0.0

    def runs_until(self, t: float) -> None:
        """The running item's work ends at ``t`` (the simulator knows: the pull's place
        on its link, a pipeline stage's timing)."""
        if self._running is not None:
            self._running.ends_at = t

    def done(self, request_id: str) -> None:
        if self._running is not None and self._running.item.request_id == request_id:
            self._running = None

    def remove(self, request_id: str) -> T | None:
        """Take a waiting item out (cancelled); the running one is not touched."""
        e = self._waiting.pop(request_id, None)
        if e is None:
            return None
        self._work -= e.work_s
        self._tokens -= e.tokens
        if not self._waiting:
            self._work = 0.0
        return e.item

    def reprice(self, cost: CostModel) -> None:
        """Price queued work with ``cost`` from now on, what is already queued included
        (the instance's calibration moved)."""
        self.cost = cost
        for e in self._waiting.values():
            e.work_s = self.price(e.item)
        self._work = sum(e.work_s for e in self._waiting.values())
        r = self._running
        if r is not None:
            r.work_s = self.price(r.item)
            r.ends_at = r.started_at + r.work_s

    def load(self) -> tuple[int, int, float]:
        """(queue_len, computed tokens, work_s): the waiting items at their price, the
        running one until its end."""
        work, tokens = self._work, self._tokens
        r = self._running
        if r is not None:
            work += max(0.0, r.ends_at - self.clock.now())
            tokens += computed_tokens(r.item)
        return len(self), tokens, max(0.0, work)


# -- the live worker's items --


def prefix_blocks(task: PrefillTask) -> int:
    """Leading blocks the conductor expects on this node before compute (the store
    reservation at compute start has the last word: :meth:`QueuedPrefill.settle`)."""
    try:
        return plan.expected_prefix_blocks(task.expected_hit_blocks, task.source)
    except plan.BadPrefix as e:
        raise BadTask(str(e)) from e


def prefix_tokens(task: PrefillTask, block_size: int) -> int:
    return plan.prefix_tokens(len(task.request.prompt_token_ids), prefix_blocks(task), block_size)


@dataclass
class QueuedPrefill:
    """A placed ``PrefillTask`` as the live worker queues it (a :class:`QueueItem`)."""

    task: PrefillTask
    prompt_tokens: int
    prefix_tokens: int
    pulled_tokens: int
    meta: Any = None  # the adapter's per-task baggage (trace context, timestamps)

    @classmethod
    def of(cls, task: PrefillTask, block_size: int, meta: Any = None) -> "QueuedPrefill":
        """What the conductor expects: its local hit, extended by the pull it planned;
        :class:`BadTask` if the remote prefix does not continue the local one."""
        prefix_blocks(task)  # BadTask
        item = cls(task, len(task.request.prompt_token_ids), 0, 0, meta)
        item.settle(
            plan.grant(task.source, prefill_hit=task.expected_hit_blocks, source_granted=True),
            block_size,
        )
        return item

    def settle(self, grant: plan.ReservationGrant, block_size: int) -> None:
        """What is on the node before compute and what of it is pulled, by ``grant``: the
        conductor's expectation, then the store reservation's answer."""
        self.prefix_tokens = grant.prefix_tokens(self.prompt_tokens, block_size)
        self.pulled_tokens = grant.pulled_tokens(self.prompt_tokens, block_size)

    @property
    def request_id(self) -> str:
        return self.task.request.request_id

    @property
    def stage_work_s(self) -> float | None:
        return None
