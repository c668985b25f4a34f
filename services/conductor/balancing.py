"""Adaptive kvcache_balancing_threshold (beyond the paper, whose §4.2 footnote leaves it
"adjusted manually"). Pure: an injected :class:`Clock`, no I/O.

What the threshold is for: Algorithm 1 pulls a remote prefix only when
``best_len / own_len > threshold``; below that it recomputes. With an exact cost model
the threshold could be 1 (let the TTFT estimate decide). It is larger in practice
because a pull costs more than the model says: the SOURCE transaction and the pull's
round trips, congestion on the holder's NIC that this conductor did not cause. So the
controller measures exactly that: how much worse than predicted placements that pulled
turned out, compared with placements that did not.

Per placement the policy calls :meth:`record` (pulled or not, predicted TTFT, placement
time); at the first token :meth:`first_token` (or :meth:`observe` with the observed TTFT,
placement -> first token). The
error ratio of one request is ``observed / max(predicted, min_predicted_s)``. At most
once per ``interval_s``, and only with ``min_samples`` outcomes since the last step::

    m_pull  = mean ratio of the requests that pulled      (none: no pulls this window)
    m_local = mean ratio of the requests that did not     (none: use 1)
    bias    = m_pull / m_local
    bias > 1 + tolerance      -> threshold = min(hi, threshold * up)     pulls overrun
    bias <= 1 + tolerance / 2 -> threshold = max(lo, threshold / down)   pulls on time
    no pull in the window     -> threshold = max(lo, threshold / down)   probe
    otherwise                 -> unchanged (dead band)

Multiplicative and bounded steps, fast up and slow down (``up`` > ``down``), so a
congested link backs pulls off at once and the controller then creeps back towards
trusting the cost model; the dead band keeps it from chattering on noise.
"""

from dataclasses import dataclass, field

from services.common.clock import Clock


@dataclass
class AdaptiveThreshold:
    """Moves the balancing threshold by how much worse pulled placements did than predicted."""

    clock: Clock
    initial: float = 2.0
    lo: float = 1.0
    hi: float = 16.0
    up: float = 1.5
    down: float = 1.1
    tolerance: float = 0.25
    interval_s: float = 5.0
    min_samples: int = 8
    min_predicted_s: float = 1e-3
    max_open: int = 100_000  # placements awaiting their first token that are remembered
    history: list[tuple[float, float, float | None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not (0 < self.lo <= self.initial <= self.hi):
            raise ValueError("need 0 < lo <= initial <= hi")
        if self.up <= 1 or self.down <= 1:
            raise ValueError("up and down must be > 1")
        self.threshold = self.initial
        self._open: dict[str, tuple[bool, float, float]] = {}
        self._pull: list[float] = []
        self._local: list[float] = []
        self._last = self.clock.now()

    def record(
        self,
        request_id: str,
        pulled: bool,
        predicted_ttft_s: float,
        placed_at: float | None = None,
    ) -> None:
        """A placement was made (at ``placed_at``, default now); ``pulled``: it transfers
        a remote prefix."""
        if len(self._open) >= self.max_open:
            self._open.pop(next(iter(self._open)))
        at = self.clock.now() if placed_at is None else placed_at
        self._open[request_id] = (pulled, predicted_ttft_s, at)

    def forget(self, request_id: str) -> None:
        self._open.pop(request_id, None)

    def observe(self, request_id: str, observed_ttft_s: float) -> float | None:
        """The first token of a recorded placement is out. Returns the new threshold
        when this outcome triggered a step, else None."""
        rec = self._open.pop(request_id, None)
        if rec is None:
            return None
        pulled, predicted, _ = rec
        ratio = max(observed_ttft_s, 0.0) / max(predicted, self.min_predicted_s)
        (self._pull if pulled else self._local).append(ratio)
        return self.maybe_adjust()

    def first_token(self, request_id: str, ts: float | None = None) -> float | None:
        """:meth:`observe` with the TTFT measured from the recorded placement time."""
        rec = self._open.get(request_id)
        if rec is None:
            return None
        return self.observe(request_id, (self.clock.now() if ts is None else ts) - rec[2])

    def maybe_adjust(self) -> float | None:
        now = self.clock.now()
        n = len(self._pull) + len(self._local)
        if now - self._last < self.interval_s or n < self.min_samples:
            return None
        bias = self.bias()
        old = self.threshold
        if bias is None or bias <= 1 + self.tolerance / 2:
            self.threshold = max(self.lo, old / self.down)
        elif bias > 1 + self.tolerance:
            self.threshold = min(self.hi, old * self.up)
        self._pull, self._local, self._last = [], [], now
        self.history.append((now, self.threshold, bias))
        return self.threshold if self.threshold != old else None

    def bias(self) -> float | None:
        """m_pull / m_local over the outcomes since the last step (None: no pull)."""
        if not self._pull:
            return None
        m_pull = sum(self._pull) / len(self._pull)
        m_local = sum(self._local) / len(self._local) if self._local else 1.0
        return m_pull / m_local
