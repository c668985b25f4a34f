"""Per prefill instance (or CPP group), how far observed TTFT runs from the predicted
one; the placement policy scales its predictions by it (services.conductor.placement_policy).
Pure."""

from dataclasses import dataclass, field

from sortedcontainers import SortedList


@dataclass
class TtftFeedback:
    """Per prefill instance, how far observed TTFT (placement to first token) runs
    from the predicted one: an exponential average of observed / predicted over the
    requests it served. The fitted compute model misses what only shows while serving
    (the engines' contention for cores, the request's bus hops, the handoff of the
    one before), and a queue estimate compounds the miss; the factor scales the
    instance's predictions so that what is accepted meets the SLO."""

    # Up fast, down slowly: a first token arrives only after the requests placed
    # meanwhile, so a factor that lags a slowdown has already over-admitted; one that
    # lags a speed-up only rejects a little early for a while.
    alpha_up: float = 0.5
    alpha_down: float = 0.05
    lo: float = 0.5
    hi: float = 8.0
    min_predicted_s: float = 0.02  # shorter predictions are mostly noise
    factors: dict[str, float] = field(default_factory=dict)
    # The factors in order (the placement search's bound needs the least), O(log n).
    _sorted: SortedList = field(default_factory=SortedList, repr=False)

    def __post_init__(self) -> None:
        self._sorted.update(self.factors.values())

    def observe(self, instance: str, predicted_s: float, observed_s: float) -> None:
        if predicted_s < self.min_predicted_s or observed_s <= 0:
            return
        r = min(self.hi, max(self.lo, observed_s / predicted_s))
        f = self.factors.get(instance)
        if f is None:
            new = r
        else:
            new = f + (self.alpha_up if r > f else self.alpha_down) * (r - f)
            self._sorted.remove(f)
        self.factors[instance] = new
        self._sorted.add(new)

    def floor(self) -> float:
        """At most every instance's factor (1.0 for one not observed yet)."""
        return min(1.0, self._sorted[0]) if self._sorted else 1.0

    def factor(self, instance: str) -> float:
        return self.factors.get(instance, 1.0)
