"""Hold a (re)started admission or conductor back until it has heard both pools.

Its view of the instances is built from load reports alone: taking requests before the
first reports arrive answers them 503 "no live prefill instance" for want of news it is
about to get (seen when admission restarted mid-load with requests held in the intake).
"""

import asyncio
import contextlib
from collections.abc import Callable, Sized


class PoolsHeard:
    """Set once both the prefill and the decode pool have reported load."""

    def __init__(self, live_prefill: Callable[[], Sized], live_decode: Callable[[], Sized]) -> None:
        self._live = (live_prefill, live_decode)
        self._heard = asyncio.Event()

    def check(self) -> None:
        """After each load report: once both pools were heard, nothing more to do (the
        live lists cost a walk over every instance)."""
        if self._heard.is_set():
            return
        if all(len(live()) for live in self._live):
            self._heard.set()

    async def wait(self, bound_s: float) -> bool:
        """Until a live instance of each role has reported, or ``bound_s`` passed (a stack
        with no worker up must still answer, 503)."""
        self.check()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._heard.wait(), bound_s)
        return self._heard.is_set()
