"""Dynamic P/D ratio (paper §5.1): a controller that samples recent prefill and decode
loads and moves capacity towards the heavier side. Pure: an injected :class:`Clock`, no
I/O. Live, the conductor (``--pd-controller``) turns its switches into RoleSwitch
messages; the simulator resizes its pools by the deltas.

Loads are in SLO units (§4.3.1): a prefill instance's ``queued_work_s / TTFT_SLO`` (in
the instance's own measured seconds), a decode instance's TBT over ``TBT_SLO``: with
a ``book``, the instance's own fitted ``decode_tbt(batch + waiting, kv_tokens,
max_batch)`` once it reported a decode fit, else the ``step_time_s`` it reports. Each
:meth:`PDRatioController.plan`::

    L_p, L_d = trimmed means of the samples of the last window_s (drop the top and
               bottom ``trim`` = 10% of each role's samples)
    f_im     = (L_d + 1) / (L_p + 1)

Per-instance load is taken to scale inversely with the pool size (a pool's demand is
``L * count``), which predicts the imbalance after a change:
``f'(P', D') = (L_d*D/D' + 1) / (L_p*P/P' + 1)``.

- ``scale == 0`` (live: a fixed fleet, role switches only): act only outside the
  hysteresis band ``low <= f_im <= high``; move one instance from the lighter to the
  heavier side, then more while each move still shrinks ``|log f'|``, at most
  ``max_step`` and never below ``min_prefill`` / ``min_decode``. The lighter side gives
  up its least-loaded instances.
- ``scale > 0`` (machine tide, scale out): add ``min(scale, max_step)`` instances, each
  to the side whose predicted per-instance load is then the higher (the heavier side
  first).
- ``scale < 0`` (scale in): remove ``min(-scale, max_step)``, each from the side whose
  per-instance load is the lower, least-loaded instances first, respecting the minima.

Needs ``min_samples`` samples of each role in the window. After any change the samples
are dropped (they describe the old pools) and nothing changes for ``cooldown_s``: that
and the band keep the controller from chasing f_im = 1 through skewed traffic.
"""

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from bus_schemas.load import DecodeLoad, PrefillLoad
from bus_schemas.roles import ROLES, Role
from services.common.calibration import CalibrationBook
from services.common.clock import Clock


@dataclass(frozen=True)
class RoleChange:
    """One instance moving from one role to the other."""

    instance: str
    from_role: str
    to_role: str


@dataclass(frozen=True)
class PDPlan:
    """The P/D controller's decision: pool size changes, role switches and why."""

    f_im: float | None
    prefill_load: float | None  # trimmed mean
    decode_load: float | None
    prefill_delta: int = 0  # change of the prefill pool size
    decode_delta: int = 0
    switches: tuple[RoleChange, ...] = ()  # scale == 0: who changes role
    remove: tuple[str, ...] = ()  # scale < 0: which instances to retire
    reason: str = ""

    @property
    def changed(self) -> bool:
        return bool(self.prefill_delta or self.decode_delta)


def trimmed_mean(values: Sequence[float], trim: float = 0.1) -> float | None:
    """Mean after dropping ``floor(trim * n)`` samples at each end (None: no samples)."""
    if not values:
        return None
    v = sorted(values)
    k = int(len(v) * trim)
    kept = v[k : len(v) - k] if len(v) > 2 * k else v
    return math.fsum(kept) / len(kept)


@dataclass
class PDRatioController:
    """Samples prefill and decode loads and moves capacity towards the heavier pool."""

    clock: Clock
    window_s: float = 60.0
    trim: float = 0.1
    high: float = 1.5
    low: float = 1 / 1.5
    max_step: int = 1
    min_prefill: int = 1
    min_decode: int = 1
    cooldown_s: float = 30.0
    min_samples: int = 10
    history: list[tuple[float, PDPlan]] = field(default_factory=list)
    book: CalibrationBook | None = None  # per-instance fitted models (the conductor's)

    def __post_init__(self) -> None:
        if not (0 < self.low <= 1 <= self.high):
            raise ValueError("need 0 < low <= 1 <= high")
        if self.max_step < 1 or not 0 <= self.trim < 0.5:
            raise ValueError("max_step >= 1 and 0 <= trim < 0.5")
        self._samples: dict[str, deque[tuple[float, str, float]]] = {r: deque() for r in ROLES}
        self._latest: dict[str, dict[str, float]] = {r: {} for r in ROLES}
        self._last_change = -math.inf

    # ------------------------------------------------------------ inputs

    def observe(self, role: str, instance: str, load: float, ts: float | None = None) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}")
        t = self.clock.now() if ts is None else ts
        self._samples[role].append((t, instance, load))
        self._latest[role][instance] = load

    def observe_prefill(self, load: PrefillLoad, ttft_slo_s: float) -> None:
        self.observe(Role.PREFILL, load.instance, load.queued_work_s / ttft_slo_s)

    def observe_decode(self, load: DecodeLoad, tbt_slo_s: float) -> None:
        # A backlog past max_batch is load too: those sequences take turns with the batch.
        if self.book is not None and self.book.calibrated(load.instance, "decode"):
            tbt = self.book.cost(load.instance).decode_tbt(
                load.batch_size + load.waiting, load.kv_tokens, load.max_batch
            )
            self.observe(Role.DECODE, load.instance, tbt / tbt_slo_s)
            return
        rounds = (
            math.ceil((load.batch_size + load.waiting) / load.max_batch) if load.max_batch else 1
        )
        self.observe(Role.DECODE, load.instance, load.step_time_s * max(rounds, 1) / tbt_slo_s)

    def forget(self, instance: str) -> None:
        """The instance left a pool (switched, died): its latest load no longer counts."""
        for r in ROLES:
            self._latest[r].pop(instance, None)

    # ------------------------------------------------------------ views

    def loads(self) -> tuple[float | None, float | None]:
        """Trimmed-mean (prefill, decode) load over the window."""
        horizon = self.clock.now() - self.window_s
        out = []
        for r in ROLES:
            q = self._samples[r]
            while q and q[0][0] < horizon:
                q.popleft()
            out.append(
                trimmed_mean([x for _, _, x in q], self.trim)
                if len(q) >= self.min_samples
                else None
            )
        return out[0], out[1]

    def imbalance(self) -> float | None:
        lp, ld = self.loads()
        return None if lp is None or ld is None else (ld + 1) / (lp + 1)

    # ------------------------------------------------------------ decisions

    def plan(self, prefill: Sequence[str], decode: Sequence[str], *, scale: int = 0) -> PDPlan:
        """What to change now, given the current pools (instance ids)."""
        lp, ld = self.loads()
        if lp is None or ld is None:
            return PDPlan(None, lp, ld, reason="not enough samples")
        f = (ld + 1) / (lp + 1)
        now = self.clock.now()
        if now - self._last_change < self.cooldown_s:
            return PDPlan(f, lp, ld, reason="cooling down")
        P, D = len(prefill), len(decode)
        dem_p, dem_d = lp * P, ld * D

        def f_after(p: int, d: int) -> float:
            return (dem_d / d + 1) / (dem_p / p + 1)

        if scale == 0:
            if self.low <= f <= self.high:
                return PDPlan(f, lp, ld, reason="within the band")
            to_decode = f > self.high
            moved = 0
            while moved < self.max_step:
                p, d = (
                    (P - moved - 1, D + moved + 1) if to_decode else (P + moved + 1, D - moved - 1)
                )
                if p < self.min_prefill or d < self.min_decode:
                    break
                cur = f_after(P - moved, D + moved) if to_decode else f_after(P + moved, D - moved)
                if moved and abs(math.log(f_after(p, d))) >= abs(math.log(cur)):
                    break
                moved += 1
            if not moved:
                return PDPlan(f, lp, ld, reason="at the pool minimum")
            src, dst = (Role.PREFILL, Role.DECODE) if to_decode else (Role.DECODE, Role.PREFILL)
            pick = self._least_loaded(src, prefill if to_decode else decode, moved)
            sign = 1 if to_decode else -1
            return self._commit(
                PDPlan(
                    f,
                    lp,
                    ld,
                    prefill_delta=-sign * moved,
                    decode_delta=sign * moved,
                    switches=tuple(RoleChange(i, src, dst) for i in pick),
                    reason=f"f_im {f:.3f} {'>' if to_decode else '<'} band: {src} -> {dst}",
                )
            )

        p, d = P, D
        if scale > 0:
            for _ in range(min(scale, self.max_step)):
                # add to whichever side is heavier per instance right now
                if dem_d / max(d, 1) >= dem_p / max(p, 1):
                    d += 1
                else:
                    p += 1
            return self._commit(
                PDPlan(
                    f,
                    lp,
                    ld,
                    prefill_delta=p - P,
                    decode_delta=d - D,
                    reason=f"scale out by {p + d - P - D}, heavier side first",
                )
            )
        for _ in range(min(-scale, self.max_step)):
            can_p, can_d = p > self.min_prefill, d > self.min_decode
            if not (can_p or can_d):
                break
            lighter_p = dem_p / p <= dem_d / d
            if (lighter_p and can_p) or not can_d:
                p -= 1
            else:
                d -= 1
        remove = self._least_loaded(Role.PREFILL, prefill, P - p) + self._least_loaded(
            Role.DECODE, decode, D - d
        )
        if not remove:
            return PDPlan(f, lp, ld, reason="at the pool minimum")
        return self._commit(
            PDPlan(
                f,
                lp,
                ld,
                prefill_delta=p - P,
                decode_delta=d - D,
                remove=tuple(remove),
                reason=f"scale in by {P + D - p - d}, lighter side first",
            )
        )

    def _least_loaded(self, role: str, instances: Sequence[str], k: int) -> list[str]:
        latest = self._latest[role]
        return sorted(instances, key=lambda i: (latest.get(i, 0.0), i))[:k]

    def _commit(self, plan: PDPlan) -> PDPlan:
        now = self.clock.now()
        self._last_change = now
        for r in ROLES:
            self._samples[r].clear()
        for c in plan.switches:
            self.forget(c.instance)
        for i in plan.remove:
            self.forget(i)
        self.history.append((now, plan))
        return plan
