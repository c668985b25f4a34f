"""When a request turned away for a full prefill pool should come back (its Retry-After),
and the room its return is promised.

The excess of its predicted TTFT over the SLO is what the request alone would have to
wait: in a burst every request turned away gets about the same small excess (the floor,
1 s), so they all come back together into the same backlog, are all turned away again,
and a client that retries twice (the ``openai`` client's default) loses them all. Here
each rejection books its own predicted prefill work on a virtual queue of promised
retries, behind the pool's real backlog and drained at the pool's rate (work over the
live prefill instances). A request is told to come back when the work ahead of it on
that queue has shrunk to half the room its SLO leaves (``budget_s`` less its own work;
the other half for the requests that arrive meanwhile): then it fits, and it is not
back sooner to be turned away again; never before the excess. The queue drains with
time, so a quiet pool answers the excess again.

With ``reserve``, a promise also holds its room: a request that comes first sees the
work of the promises due before it would start as queued ahead of it (:meth:`ahead`),
so new arrivals do not take the room a retry was told to expect, and are told to come
back after it instead. A request comes back as itself (``key``: its prompt's last block
hash and length); :meth:`claim` takes its own promise out, and only the promises made
before its own are ahead of it (first promised, first served). A promise not claimed
``grace_s`` after its time lapses (a client that gave up). Only a request turned away
before holds room (``hold_from``): a first retry competes with the new arrivals as they
come, which keeps the room for first attempts that can still meet their SLO; a second
one, the ``openai`` client's last, is kept its place, so the conversation is served
late rather than lost. The simulator's clients never retry, so it runs without
``reserve``.

A short request passes the promises (:meth:`passes`: its own work at most
``pass_share`` of the room its SLO leaves): a conversation's next turn, mostly a cache
hit, delays a promised retry by little, and the promise leaves the other half of its
room for arrivals. Held behind promised first turns, such turns were turned away
themselves (goodput 33 against vLLM's 55 at 2x load, BENCHMARKS.md), though they are the
cheapest work there is.

Pure: the caller passes the time. The wait is bounded by ``horizon_s`` (the ``openai``
client honours up to 60 s).
"""

import heapq
import itertools
import math
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RetrySchedule:
    """A virtual queue of the prefill work promised to come back, with its end time."""

    horizon_s: float = 30.0
    room_share: float = 0.5  # of the room its SLO leaves: the rest for new arrivals
    reserve: bool = False
    grace_s: float = 2.0
    pass_share: float = 0.1  # of its room: a request this short is not held by promises
    # A promise holds its room from the request's hold_from-th rejection on (1: every
    # promise): the first retry competes with new arrivals, a later one (the ``openai``
    # client's last) is kept its place.
    hold_from: int = 2
    _until: float = 0.0  # the real backlog and the promised retries are served by then
    # key -> (due, seconds of the pool's time, order made); a heap of (due + grace, key)
    # lapses them.
    _promised: dict[Hashable, tuple[float, float, int]] = field(default_factory=dict)
    _lapse: list[tuple[float, Hashable]] = field(default_factory=list)
    _made: "itertools.count[int]" = field(default_factory=itertools.count)
    # key -> (when its last rejection is due back, rejections); a heap of (due + grace,
    # key) forgets a request that did not come back.
    _turned: dict[Hashable, tuple[float, int]] = field(default_factory=dict)
    _forget: list[tuple[float, Hashable]] = field(default_factory=list)

    def retry_after(
        self,
        now: float,
        earliest_s: float,
        work_s: float,
        servers: int,
        backlog_s: float = 0.0,
        budget_s: float = 0.0,
        key: Hashable | None = None,
    ) -> float:
        """Seconds until the request turned away at ``now`` should come back, and books
        its ``work_s`` (seconds of one instance) on the pool of ``servers`` instances.

        ``backlog_s``: the real queue ahead of it now (seconds); ``budget_s``: what its
        SLO leaves for queue and compute; ``earliest_s``: the floor; ``key``: what it
        comes back as (promised when ``reserve``)."""
        end = max(self._until, now + max(0.0, backlog_s))
        start = max(now + earliest_s, end - max(0.0, budget_s - work_s) * self.room_share)
        if start - now >= self.horizon_s:
            return self.horizon_s  # not booked: the queue never grows past the horizon
        share = max(0.0, work_s) / max(1, servers)
        self._until = end + share
        if self.reserve and key is not None:
            self._expire(now)
            times = self._turned.get(key, (0.0, 0))[1] + 1
            self._turned[key] = (start, times)
            heapq.heappush(self._forget, (start + self.grace_s, key))
            if times >= self.hold_from:
                self._promised[key] = (start, share, next(self._made))
                heapq.heappush(self._lapse, (start + self.grace_s, key))
        return start - now

    def claim(self, key: Hashable | None, now: float) -> float:
        """The request ``key`` is here: its own promise is no longer ahead of anyone.
        Returns when that promise was made, in order (``inf``: it had none), for
        :meth:`ahead`."""
        self._expire(now)
        p = self._promised.pop(key, None) if key is not None else None
        return math.inf if p is None else p[2]

    def ahead(self, now: float, by: float, made_before: float = math.inf) -> float:
        """Seconds of the pool's time promised to retries due at or before ``by``, of the
        promises made before ``made_before`` (what :meth:`claim` returned)."""
        self._expire(now)
        return sum(
            share
            for due, share, made in self._promised.values()
            if due <= by and made < made_before
        )

    def _expire(self, now: float) -> None:
        _lapse(self._lapse, self._promised, self.grace_s, now)
        _lapse(self._forget, self._turned, self.grace_s, now)

    def passes(self, work_s: float, budget_s: float) -> bool:
        """Whether a request of ``work_s`` seconds of compute, its SLO leaving it
        ``budget_s``, goes ahead of the promised retries."""
        return work_s <= self.pass_share * budget_s


def _lapse(
    heap: list[tuple[float, Hashable]], due: dict[Hashable, Any], grace: float, now: float
) -> None:
    """Drops the entries of ``due`` (key -> (due time, ...)) whose due time plus
    ``grace`` has passed; ``heap`` holds (due + grace, key) for each time one was set
    (an entry set again later outlives its older heap items)."""
    while heap and heap[0][0] <= now:
        at, key = heapq.heappop(heap)
        entry = due.get(key)
        if entry is not None and entry[0] + grace <= at:
            del due[key]
