"""When a request turned away for a full prefill pool should come back (its Retry-After).

The excess of its predicted TTFT over the SLO is what the request alone would have to
wait: in a burst every request turned away gets about the same small excess (the floor,
1 s), so they all come back together into the same backlog, are all turned away again,
and a client that retries twice (the ``openai`` client's default) loses them all. Here
each rejection books its own predicted prefill work on a virtual queue of promised
retries, drained at the pool's rate (work over the live prefill instances); its
Retry-After is when its turn on that queue comes, never before the excess. The queue
drains with time, so a quiet pool answers the excess again.

Pure: the caller passes the time. The booking changes only what a 429 says, never what
is admitted, so a client that does not come back costs the others at most a later
Retry-After, bounded by ``horizon_s`` (the ``openai`` client honours up to 60 s).
"""

from dataclasses import dataclass


@dataclass
class RetrySchedule:
    """A virtual queue of the prefill work promised to come back, with its end time."""

    horizon_s: float = 30.0
    _until: float = 0.0  # the virtual queue of promised retries drains by then

    def retry_after(self, now: float, earliest_s: float, work_s: float, servers: int) -> float:
        """Seconds until the request turned away at ``now`` should come back: at least
        ``earliest_s``, after the work booked by those turned away before it; books its
        ``work_s`` (seconds of one instance) on the pool of ``servers`` instances."""
        start = max(now + earliest_s, self._until)
        if start - now >= self.horizon_s:
            return self.horizon_s  # not booked: the queue never grows past the horizon
        self._until = start + max(0.0, work_s) / max(1, servers)
        return start - now
