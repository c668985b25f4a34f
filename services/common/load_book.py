"""Every instance's latest load report, by role, which instances are alive, and the cost
model each one's reports carry: the one book that admission and placement both keep.

Pure: the caller feeds reports and asks with its injected clock. An instance is alive
while its last report is at most ``dead_after_s`` old; a role switch forgets it in the
role it left, and for ``dead_after_s`` after it a report in that role is one the
instance sent before it heard the switch, late on the bus, and ignored (taken again
later: a worker that did not switch goes on reporting). A report of an older
incarnation than the one known is a dead process's, late on the bus, and ignored.
"""

from sortedcontainers import SortedList

from bus_schemas.load import DecodeLoad, PrefillLoad
from bus_schemas.roles import Role
from services.common import defaults
from services.common.calibration import CalibrationBook
from services.common.clock import Clock
from services.common.cost_model import CostModel
from services.common.incarnation import STALE, judge
from services.common.liveness import OrderedLiveness

PREFILL, DECODE = Role.PREFILL, Role.DECODE
PRUNE_EVERY = 1024
FORGET_AFTER_S = 600.0


class LoadBook:
    """Every instance's latest load report and fitted costs, and which instances are alive."""

    def __init__(
        self,
        clock: Clock,
        cost: CostModel,
        *,
        dead_after_s: float = defaults.DEAD_AFTER_S,
        calibration: CalibrationBook | None = None,
    ) -> None:
        self.calibration = calibration if calibration is not None else CalibrationBook(cost)
        self.prefill: dict[str, PrefillLoad] = {}
        self.decode: dict[str, DecodeLoad] = {}
        # (role, instance) switched away -> until when a report there is a late one.
        self._left: dict[tuple[str, str], float] = {}
        # Each role's names in order and the silent ones in time order: a random pick
        # among the live instances (the placement's ``random`` strategy) without a walk.
        self._names: dict[str, SortedList] = {PREFILL: SortedList(), DECODE: SortedList()}
        self.clock = clock
        self._liveness = OrderedLiveness(clock, dead_after_s)
        self._observed = 0
        # Bumped whenever a name enters or leaves ``names``: what is built over the names
        # (the placement's CPP groups) knows when to build again.
        self.version = 0

    @property
    def dead_after_s(self) -> float:
        """A report older than this and its instance counts as dead."""
        return self._liveness.dead_after_s

    def observe_prefill(self, load: PrefillLoad) -> str:
        """Take a report; what it was (services.common.incarnation.judge): a stale one
        is ignored."""
        self._amortized_prune()
        if self._left and self._late(PREFILL, load.instance):
            return STALE
        verdict = judge(self.incarnation(PREFILL, load.instance), load.incarnation)
        if verdict != STALE:
            if load.instance not in self.prefill:
                self._names[PREFILL].add(load.instance)
                self.version += 1
            self.prefill[load.instance] = load
            self._liveness.seen(f"{PREFILL}:{load.instance}")
            self.calibration.observe_fit(load.instance, load.fit)
        return verdict

    def observe_decode(self, load: DecodeLoad) -> str:
        """As :meth:`observe_prefill`."""
        self._amortized_prune()
        if self._left and self._late(DECODE, load.instance):
            return STALE
        verdict = judge(self.incarnation(DECODE, load.instance), load.incarnation)
        if verdict != STALE:
            if load.instance not in self.decode:
                self._names[DECODE].add(load.instance)
                self.version += 1
            self.decode[load.instance] = load
            self._liveness.seen(f"{DECODE}:{load.instance}")
            self.calibration.observe_fit(load.instance, load.fit)
        return verdict

    def incarnation(self, role: str, instance: str) -> int:
        """The incarnation ``instance`` last reported in ``role`` (0: none, or unknown)."""
        ld = (self.prefill if role == PREFILL else self.decode).get(instance)
        return ld.incarnation if ld is not None else 0

    def forget(self, role: str, instance: str) -> None:
        """``instance`` left ``role`` (a role switch): its last report there no longer counts."""
        self._drop(role, instance)
        self._liveness.forget(f"{role}:{instance}")
        # Its report sent just before it heard the switch may still be on the bus: one
        # believed would put it back in the pool it left, and a task sent there once
        # it stopped serving that role would be lost.
        self._left[(role, instance)] = self.clock.now() + self.dead_after_s

    def _late(self, role: str, instance: str) -> bool:
        until = self._left.get((role, instance))
        if until is None:
            return False
        if self.clock.now() < until:
            return True
        del self._left[(role, instance)]
        return False

    def _amortized_prune(self) -> None:
        """Names come and go with scaling: every PRUNE_EVERY reports, forget those
        silent for FORGET_AFTER_S (so the book stays the size of the live cluster)."""
        self._observed += 1
        if self._observed % PRUNE_EVERY == 0:
            self.prune(FORGET_AFTER_S)

    def prune(self, older_than_s: float) -> int:
        """Forget instances silent for more than ``older_than_s``; how many."""
        gone = self._liveness.prune(older_than_s)
        now = self.clock.now()
        for left in [k for k, until in self._left.items() if until <= now]:
            del self._left[left]
        for key in gone:
            role, _, instance = key.partition(":")
            self._drop(role, instance)
        return len(gone)

    def _drop(self, role: str, instance: str) -> None:
        if (self.prefill if role == PREFILL else self.decode).pop(instance, None) is not None:
            self._names[role].remove(instance)
            self.version += 1

    def alive(self, role: str, instance: str) -> bool:
        return self._liveness.alive(f"{role}:{instance}")

    def names(self, role: str) -> SortedList:
        """The names of ``role`` with a report in the book, in order (read only)."""
        return self._names[role]

    def silent(self, role: str) -> list[str]:
        """The names of ``role`` in the book that are not alive now: O(silent), not a
        walk over every name."""
        head = f"{role}:"
        return [k[len(head) :] for k in self._liveness.silent() if k.startswith(head)]

    def live_prefill(self) -> list[PrefillLoad]:
        """The live prefill instances' latest reports, by instance name."""
        return [v for k, v in sorted(self.prefill.items()) if self.alive(PREFILL, k)]

    def live_decode(self) -> list[DecodeLoad]:
        """The live decode instances' latest reports, by instance name."""
        return [v for k, v in sorted(self.decode.items()) if self.alive(DECODE, k)]
