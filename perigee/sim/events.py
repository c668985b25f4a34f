"""The discrete-event loop: a heap of timed callbacks and the simulated clock.

Every policy object in the simulator reads time from :attr:`EventLoop.clock` (a
:class:`~services.common.clock.ManualClock`), which the loop moves to each event's
time before running it. Events at equal times run in the order they were scheduled.
Cancelling is by generation: a component that reschedules bumps its own counter and
ignores events carrying an older one (cheaper than removing them from the heap).
"""

import heapq
import itertools
from collections.abc import Callable
from typing import Any

from services.common.clock import ManualClock


class EventLoop:
    """The simulator's discrete-event loop: callbacks in time order on a manual clock."""

    def __init__(self, start: float = 0.0) -> None:
        self.clock = ManualClock(start)
        self._heap: list[tuple[float, int, Callable[..., Any], tuple]] = []
        self._seq = itertools.count()
        self.events_run = 0

    def now(self) -> float:
        return self.clock.t

    def at(self, t: float, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` at sim time ``t`` (never before now)."""
        if t < self.clock.t:
            t = self.clock.t
        heapq.heappush(self._heap, (t, next(self._seq), fn, args))

    def after(self, dt: float, fn: Callable[..., Any], *args: Any) -> None:
        self.at(self.clock.t + dt, fn, *args)

    def pending(self) -> int:
        return len(self._heap)

    def run(self, until: float | None = None) -> None:
        """Run events in time order until none is left (or the next is after ``until``)."""
        heap, clock = self._heap, self.clock
        pop = heapq.heappop
        while heap:
            if until is not None and heap[0][0] > until:
                clock.set(until)
                return
            t, _, fn, args = pop(heap)
            if t > clock.t:
                clock.t = t
            self.events_run += 1
            fn(*args)
