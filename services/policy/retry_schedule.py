"""When a request turned away for a full prefill pool should come back (its Retry-After).

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

Pure: the caller passes the time. The booking changes only what a 429 says, never what
is admitted, so a client that does not come back costs the others at most a later
Retry-After, bounded by ``horizon_s`` (the ``openai`` client honours up to 60 s).
"""

from dataclasses import dataclass


@dataclass
class RetrySchedule:
    """A virtual queue of the prefill work promised to come back, with its end time."""

    horizon_s: float = 30.0
    room_share: float = 0.5  # of the room its SLO leaves: the rest for new arrivals
    _until: float = 0.0  # the real backlog and the promised retries are served by then

    def retry_after(
        self,
        now: float,
        earliest_s: float,
        work_s: float,
        servers: int,
        backlog_s: float = 0.0,
        budget_s: float = 0.0,
    ) -> float:
        """Seconds until the request turned away at ``now`` should come back, and books
        its ``work_s`` (seconds of one instance) on the pool of ``servers`` instances.

        ``backlog_s``: the real queue ahead of it now (seconds); ``budget_s``: what its
        SLO leaves for queue and compute; ``earliest_s``: the floor."""
        end = max(self._until, now + max(0.0, backlog_s))
        start = max(now + earliest_s, end - max(0.0, budget_s - work_s) * self.room_share)
        if start - now >= self.horizon_s:
            return self.horizon_s  # not booked: the queue never grows past the horizon
        self._until = end + max(0.0, work_s) / max(1, servers)
        return start - now
