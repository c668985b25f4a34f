"""Which instances are alive, judged by when each last reported load, and which
incarnation of each name is the live one (services.common.incarnation).

Pure: the caller feeds sightings and asks with its own clock. The gateway uses it to
fail streams whose worker went silent or restarted; the conductor to stop placing on it."""

from collections.abc import Collection

from sortedcontainers import SortedList

from services.common import defaults
from services.common.clock import Clock
from services.common.incarnation import SAME, STALE, judge


class Liveness:
    """Which instances reported recently enough to count as alive, and their live incarnations."""

    def __init__(self, clock: Clock, dead_after_s: float = defaults.DEAD_AFTER_S) -> None:
        self.clock = clock
        self.dead_after_s = dead_after_s
        self._last: dict[str, float] = {}
        self._incarnation: dict[str, int] = {}
        self.names_version = 0  # moves when a name is first seen or forgotten

    def seen(self, instance: str, incarnation: int = 0) -> str:
        """A sign of life of ``instance`` (of ``incarnation``, 0: unknown); what it was
        (SAME, RESTARTED, or STALE: a dead incarnation's, ignored)."""
        verdict = judge(self._incarnation.get(instance), incarnation) if incarnation else SAME
        if verdict == STALE:
            return verdict
        if instance not in self._last:
            self.names_version += 1
        self._last[instance] = self.clock.now()
        if incarnation:
            self._incarnation[instance] = incarnation
        return verdict

    def incarnation(self, instance: str) -> int:
        """The live incarnation of ``instance`` (0: unknown)."""
        return self._incarnation.get(instance, 0)

    def forget(self, instance: str) -> None:
        if self._last.pop(instance, None) is not None:
            self.names_version += 1
        self._incarnation.pop(instance, None)

    def names(self) -> Collection[str]:
        """Every name with a sighting (alive or not), as a live view."""
        return self._last.keys()

    def prune(self, older_than_s: float) -> list[str]:
        """Forget instances silent for more than ``older_than_s``; those forgotten."""
        now = self.clock.now()
        gone = [i for i, t in self._last.items() if now - t > older_than_s]
        for i in gone:
            self.forget(i)
        return gone

    def known(self, instance: str) -> bool:
        return instance in self._last

    def alive(self, instance: str) -> bool:
        t = self._last.get(instance)
        return t is not None and self.clock.now() - t <= self.dead_after_s

    def alive_instances(self) -> list[str]:
        now = self.clock.now()
        return [i for i, t in self._last.items() if now - t <= self.dead_after_s]


class OrderedLiveness(Liveness):
    """:class:`Liveness` that also keeps its sightings in time order, so that the silent
    ones are found without a walk over every name: O(log n) per sighting, O(silent)
    per :meth:`silent`."""

    def __init__(self, clock: Clock, dead_after_s: float = defaults.DEAD_AFTER_S) -> None:
        super().__init__(clock, dead_after_s)
        self._by_time: SortedList = SortedList()

    def seen(self, instance: str, incarnation: int = 0) -> str:
        before = self._last.get(instance)
        verdict = super().seen(instance, incarnation)
        after = self._last.get(instance)
        if after != before:
            if before is not None:
                self._by_time.remove((before, instance))
            self._by_time.add((after, instance))
        return verdict

    def forget(self, instance: str) -> None:
        t = self._last.get(instance)
        if t is not None:
            self._by_time.remove((t, instance))
        super().forget(instance)

    def prune(self, older_than_s: float) -> list[str]:
        """As :meth:`Liveness.prune` (those forgotten, oldest first), from the oldest
        sighting on: O(forgotten log n), not a walk over every name."""
        now, gone = self.clock.now(), []
        for t, instance in self._by_time:
            if now - t <= older_than_s:
                break
            gone.append(instance)
        for i in gone:
            self.forget(i)
        return gone

    def silent(self) -> list[str]:
        """The known names not alive now (as :meth:`alive` judges), oldest first."""
        now, out = self.clock.now(), []
        for t, instance in self._by_time:
            if now - t <= self.dead_after_s:
                break
            out.append(instance)
        return out
