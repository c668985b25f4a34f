"""Injected clocks: policy code never reads time itself."""

import time
from collections.abc import Awaitable, Callable
from typing import Protocol

# An injected sleep (asyncio.sleep live; one that moves a ManualClock in tests).
SleepFn = Callable[[float], Awaitable[object]]


class Clock(Protocol):
    """Anything that tells the time in seconds: injected wherever time matters."""

    def now(self) -> float: ...


class WallClock:
    """Monotonic seconds for durations and deadlines."""

    def now(self) -> float:
        return time.monotonic()


class UnixClock:
    """Unix seconds: the time base of timestamps that cross processes (load reports'
    and notices' ``ts``, a request's ``arrival_ts``)."""

    def now(self) -> float:
        return time.time()


class ManualClock:
    """A clock tests and the simulator move by hand."""

    def __init__(self, start: float = 0.0) -> None:
        self.t = start

    def now(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        if dt < 0:
            raise ValueError("time does not go backwards")
        self.t += dt

    def set(self, t: float) -> None:
        if t < self.t:
            raise ValueError("time does not go backwards")
        self.t = t
