"""Which instances are alive, judged by when each last reported load.

Pure: the caller feeds sightings and asks with its own clock. The gateway uses it to
fail streams whose worker went silent; the conductor to stop placing on it."""

from services.common.clock import Clock


class Liveness:
    def __init__(self, clock: Clock, dead_after_s: float = 2.0) -> None:
        self.clock = clock
        self.dead_after_s = dead_after_s
        self._last: dict[str, float] = {}

    def seen(self, instance: str) -> None:
        self._last[instance] = self.clock.now()

    def forget(self, instance: str) -> None:
        self._last.pop(instance, None)

    def known(self, instance: str) -> bool:
        return instance in self._last

    def alive(self, instance: str) -> bool:
        t = self._last.get(instance)
        return t is not None and self.clock.now() - t <= self.dead_after_s

    def alive_instances(self) -> list[str]:
        now = self.clock.now()
        return [i for i, t in self._last.items() if now - t <= self.dead_after_s]
