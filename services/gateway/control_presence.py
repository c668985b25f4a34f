"""Which admission and conductor processes are alive, from their beats. Pure.

On the core path (the default; not ``--durable-intake``) the gateway's request travels
as a core NATS message: REQUESTS to one admission, then SCHEDULE to one conductor. A
process that dies holding it (between receipt and the conductor's ``Accepted``) takes
it along, and no stream hands it to another. The gateway knows what it sent and what
was placed, so it resends what was not placed yet when an admission or a conductor
dies (as it resends after a NATS server's loss: services.gateway.replies). A death is
either

    silence    no beat from a name for ``dead_after_s`` (at least four of its
               beat intervals), judged only while the gateway's own input is fresh
    restart    a beat of a newer incarnation under a known name (a supervisor or a
               Kubernetes container restart): at once, even after a silence was
               judged a death already, since a hung process (stopped, swapping) keeps
               its subscriptions and took its share of what was sent meanwhile

Names are unique per kind (a conductor's id, admission's ``--id``). Beats of an older
incarnation than the known one are late messages of a dead process, and ignored.
The processes here are a handful, so a sweep walks them all."""

from dataclasses import dataclass

from services.common.clock import Clock
from services.common.incarnation import RESTARTED, STALE, judge

# A name silent this long is forgotten (Kubernetes pod names churn).
FORGET_S = 600.0


@dataclass(slots=True)
class _Beat:
    incarnation: int
    last: float
    limit: float  # seconds of silence that make it dead
    judged: bool = False  # its silence was reported as a death already


class ControlPresence:
    """The admission and conductor processes heard, each by ``kind:name``."""

    def __init__(self, clock: Clock, dead_after_s: float) -> None:
        self.clock = clock
        self.dead_after_s = dead_after_s
        self._beats: dict[str, _Beat] = {}

    def seen(self, kind: str, name: str, incarnation: int, interval_s: float) -> str | None:
        """A beat. Returns the key of a process it proves dead (an older incarnation
        under this name), else None."""
        key = f"{kind}:{name}"
        b = self._beats.get(key)
        verdict = judge(None if b is None else b.incarnation, incarnation)
        if verdict == STALE:
            return None
        limit = max(self.dead_after_s, 4 * interval_s)
        self._beats[key] = _Beat(incarnation, self.clock.now(), limit)
        return key if verdict == RESTARTED else None

    def silent(self) -> list[str]:
        """The processes silent past their limit and not reported yet: each is a death,
        reported once (a beat of it again makes it alive again)."""
        now = self.clock.now()
        gone = []
        for k, b in list(self._beats.items()):
            if now - b.last > max(FORGET_S, b.limit):
                del self._beats[k]
            elif not b.judged and now - b.last > b.limit:
                b.judged = True
                gone.append(k)
        return gone

    def known(self, kind: str) -> bool:
        """Whether a process of ``kind`` was heard (alive, or dead not long ago)."""
        prefix = f"{kind}:"
        return any(k.startswith(prefix) for k in self._beats)

    def alive(self, kind: str) -> list[str]:
        """The names of ``kind`` heard within their limit."""
        now = self.clock.now()
        prefix = f"{kind}:"
        return [
            k[len(prefix) :]
            for k, b in self._beats.items()
            if k.startswith(prefix) and now - b.last <= b.limit
        ]
