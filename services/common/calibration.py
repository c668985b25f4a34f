"""Online calibration: each instance's own cost model, fitted from what it measures
while serving (the paper's constants are a prior, not the truth). Pure: no I/O, no
clock; the worker feeds samples, consumers read coefficients.

The form is eq. 1's plus a fixed per-request (per-step) cost, linear in its
coefficients, all non-negative::

    prefill(n, p) = c0 + c1*(n - p) + c2*(n^2 - p^2)        (n prompt, p reused tokens)
    decode step   = d0 + d1*batch + d2*context              (context: tokens in the batch)

:func:`fit_form` solves for the coefficients from a window of recent samples:

- **relative error**: residuals are ``(predicted - measured) / measured``, so a 30 ms
  prompt counts as much as a 3 s one (the target is a relative error per request);
- **recency**: sample weights halve every ``half_life`` samples, so the fit follows an
  engine that slows down when others start sharing its cores;
- **robust**: Huber IRLS on the relative residuals (threshold 1.345 x the MAD scale),
  so one prefill stretched by a page fault moves the fit by a fraction of a percent;
- **prior**: ridge toward the prior's coefficients scaled by ``alpha``, the weighted
  median of measured / prior-predicted, so from the first sample the prior's *shape*
  is kept at the measured *speed* and later samples reshape it;
- **non-negative**: exact NNLS over the 2^3 active sets (three unknowns).

:class:`OnlineFit` keeps one instance's windows and refits lazily;
:class:`CalibrationBook` maps instance -> model on the consumer side (conductor,
admission, P/D controller), from the coefficients the instances report
(``PrefillLoad.fit`` / ``DecodeLoad.fit``). A book made ``fixed`` (a hand-given
``--cost-model``) ignores them.
"""

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import fields
from itertools import combinations
from typing import Any

import numpy as np

from services.common.cost_fit import FittedCostModel, Poly2D
from services.common.cost_floor import CostFloor
from services.common.cost_model import CostModel

Coef = tuple[float, float, float]

_ANALYTIC = [f.name for f in fields(CostModel) if f.name != "speedup"]
HUBER_K = 1.345
MIN_SECONDS = 1e-5  # measured times below this (speedup inf) are floored for weighting


def prefill_features(n: float, p: float) -> tuple[float, float, float]:
    p = min(max(p, 0), n)
    return 1.0, float(n - p), float(n * n - p * p)


def decode_features(batch: float, context: float) -> tuple[float, float, float]:
    return 1.0, float(batch), float(context)


# ------------------------------------------------------------------ the solver


def _nnls_ridge(a: np.ndarray, b: np.ndarray, lam: float, g0: np.ndarray) -> np.ndarray:
    """argmin |a g - b|^2 + lam |g - g0|^2 subject to g >= 0 (exact, small k)."""
    k = a.shape[1]
    aa = np.vstack([a, math.sqrt(lam) * np.eye(k)]) if lam > 0 else a
    bb = np.concatenate([b, math.sqrt(lam) * g0]) if lam > 0 else b

    def solve(free: Sequence[int]) -> np.ndarray:
        g = np.zeros(k)
        if free:
            g[list(free)] = np.linalg.lstsq(aa[:, list(free)], bb, rcond=None)[0]
        return g

    g = solve(range(k))
    if np.all(g >= 0):
        return g
    best, best_cost = np.zeros(k), float(np.sum(bb**2))
    for size in range(k - 1, 0, -1):
        for free in combinations(range(k), size):
            g = solve(free)
            if np.all(g >= 0):
                cost = float(np.sum((aa @ g - bb) ** 2))
                if cost < best_cost:
                    best, best_cost = g, cost
    return best


def _weighted_median(x: np.ndarray, w: np.ndarray) -> float:
    order = np.argsort(x)
    cw = np.cumsum(w[order])
    return float(x[order][np.searchsorted(cw, 0.5 * cw[-1])])


def fit_form(
    x: np.ndarray,
    t: np.ndarray,
    prior: Sequence[float],
    *,
    half_life: float = 16.0,
    prior_weight: float = 0.01,
    iters: int = 10,
) -> Coef:
    """Coefficients of ``t ~ x @ c`` (rows of ``x``: features, oldest sample first);
    see the module docstring. With no samples: ``prior``."""
    prior_c = np.asarray(prior, dtype=np.float64)
    if len(t) == 0:
        return tuple(float(v) for v in prior_c)  # type: ignore[return-value]
    x = np.asarray(x, dtype=np.float64)
    t = np.maximum(np.asarray(t, dtype=np.float64), MIN_SECONDS)
    age = np.arange(len(t) - 1, -1, -1, dtype=np.float64)
    w = 0.5 ** (age / half_life)
    z = x / t[:, None]  # relative residual of row i: z_i @ c - 1
    pred0 = z @ prior_c
    alpha = _weighted_median(1.0 / pred0[pred0 > 0], w[pred0 > 0]) if np.any(pred0 > 0) else 1.0
    # Columns scaled so each has unit weighted RMS: the ridge is then in units of
    # "samples' worth" for every coefficient alike.
    scale = np.sqrt((w[:, None] * z**2).sum(axis=0) / w.sum())
    scale[scale == 0] = 1.0
    zs = z / scale
    g0 = alpha * prior_c * scale
    h = np.ones_like(t)
    g = g0
    for _ in range(iters):
        sw = np.sqrt(w * h)
        g = _nnls_ridge(zs * sw[:, None], sw, prior_weight, g0)
        r = np.abs(zs @ g - 1.0)
        sigma = 1.4826 * _weighted_median(r, w)
        delta = max(HUBER_K * sigma, 0.02)
        h_new = np.where(r <= delta, 1.0, delta / np.maximum(r, 1e-12))
        if np.allclose(h_new, h, rtol=1e-3, atol=1e-6):
            break
        h = h_new
    return tuple(float(v) for v in g / scale)  # type: ignore[return-value]


# ------------------------------------------------------------------ the prior's coefficients


def prior_prefill(cost: CostModel, max_tokens: int = 8192) -> Coef:
    """``cost.prefill_time`` projected on the eq. 1 form (exact for the analytic model
    and for a model this module built)."""
    pts = []
    n = 16
    while n <= max_tokens:
        pts += [(n, 0), (n, n // 4), (n, n // 2)]
        n *= 2
    x = np.array([prefill_features(n, p) for n, p in pts])
    t = np.array([cost.prefill_time(n, p) for n, p in pts])
    return _project(x, t)


def prior_decode(cost: CostModel, max_batch: int = 64, max_context: int = 65536) -> Coef:
    pts = [(b, c) for b in (1, 4, 16, max_batch) for c in (b * 64, max_context // 4, max_context)]
    x = np.array([decode_features(b, c) for b, c in pts])
    t = np.array([cost.decode_step_time(b, c) for b, c in pts])
    return _project(x, t)


def _project(x: np.ndarray, t: np.ndarray) -> Coef:
    if not np.any(t > 0):
        return (0.0, 0.0, 0.0)
    scale = np.abs(x).max(axis=0)
    c = _nnls_ridge(x / scale, t, 0.0, np.zeros(3)) / scale
    return tuple(float(v) for v in c)  # type: ignore[return-value]


# ------------------------------------------------------------------ CostModel from coefficients


def prefill_poly(c: Sequence[float]) -> Poly2D:
    c0, c1, c2 = c
    return Poly2D(((0, 0, c0), (1, 0, c1), (0, 1, -c1), (2, 0, c2), (0, 2, -c2)))


def decode_poly(d: Sequence[float]) -> Poly2D:
    d0, d1, d2 = d
    return Poly2D(((0, 0, d0), (1, 0, d1), (0, 1, d2)))


def model_from(
    prior: CostModel,
    prefill: Sequence[float] | None,
    decode: Sequence[float] | None,
    meta: dict[str, Any] | None = None,
) -> CostModel:
    """``prior`` with its prefill and/or decode times replaced by the fitted form, in
    measured seconds (transfer times and KV sizes stay the prior's)."""
    if prefill is None and decode is None:
        return prior
    speed = prior.speedup
    # A part not given stays the prior's: analytic (None), or a fit of the prior's own,
    # projected on the form so that it is in seconds like the rest.
    if prefill is None and getattr(prior, "prefill_fit", None) is not None:
        prefill = prior_prefill(prior)
    if decode is None and getattr(prior, "decode_fit", None) is not None:
        decode = prior_decode(prior)
    pf = prefill_poly(prefill) if prefill is not None else None
    df = decode_poly(decode) if decode is not None else None
    return FittedCostModel(
        **{name: getattr(prior, name) for name in _ANALYTIC},
        speedup=speed,
        prefill_fit=pf,
        decode_fit=df,
        # _fitted() scales by fitted_speedup / speedup: 1, the fit is in seconds already.
        fitted_speedup=speed if math.isfinite(speed) else 1.0,
        meta=dict(meta or {}),
    )


# ------------------------------------------------------------------ one instance


class OnlineFit:
    """One instance's fit. ``prior`` (the analytic model, or a fit kept on disk) gives
    the coefficients before any sample and the shape the ridge pulls toward."""

    def __init__(
        self,
        prior: CostModel,
        *,
        window: int = 64,
        half_life: float = 16.0,
        decode_window: int = 256,
        decode_half_life: float = 64.0,
        prior_weight: float = 0.01,
    ) -> None:
        self.prior = prior
        self.prior_prefill = prior_prefill(prior)
        self.prior_decode = prior_decode(prior)
        self.half_life, self.decode_half_life = half_life, decode_half_life
        self.prior_weight = prior_weight
        self._prefill: deque[tuple[Coef, float]] = deque(maxlen=window)
        self._decode: deque[tuple[Coef, float]] = deque(maxlen=decode_window)
        self.prefill_samples = 0  # every sample ever added (the windows keep the latest)
        self.decode_samples = 0
        self._pc: Coef | None = None
        self._dc: Coef | None = None
        self._model: CostModel | None = None

    def add_prefill(self, n: int, p: int, seconds: float) -> None:
        if n <= p or not math.isfinite(seconds) or seconds < 0:
            return  # nothing computed, or a broken clock: no information
        self._prefill.append((prefill_features(n, p), seconds))
        self.prefill_samples += 1
        self._pc = self._model = None

    def add_decode(self, batch: int, context: int, seconds: float) -> None:
        if batch <= 0 or not math.isfinite(seconds) or seconds < 0:
            return
        self._decode.append((decode_features(batch, context), seconds))
        self.decode_samples += 1
        self._dc = self._model = None

    def prefill_coef(self) -> Coef:
        if self._pc is None:
            self._pc = self._fit(self._prefill, self.prior_prefill, self.half_life)
        return self._pc

    def decode_coef(self) -> Coef:
        if self._dc is None:
            self._dc = self._fit(self._decode, self.prior_decode, self.decode_half_life)
        return self._dc

    def _fit(self, window: Iterable[tuple[Coef, float]], prior: Coef, half_life: float) -> Coef:
        rows = list(window)
        x = np.array([f for f, _ in rows]).reshape(len(rows), 3)
        t = np.array([s for _, s in rows])
        return fit_form(x, t, prior, half_life=half_life, prior_weight=self.prior_weight)

    def model(self) -> CostModel:
        """A CostModel whose prefill and decode times are this instance's fit."""
        if self._model is None:
            self._model = model_from(
                self.prior,
                self.prefill_coef(),
                self.decode_coef(),
                {
                    "source": "online",
                    "prefill_samples": self.prefill_samples,
                    "decode_samples": self.decode_samples,
                },
            )
        return self._model


# ------------------------------------------------------------------ consumers


class CalibrationBook:
    """instance -> its own cost model, from the coefficients it reports. Instances
    not heard from (or a ``fixed`` book) get ``prior``."""

    def __init__(self, prior: CostModel, *, fixed: bool = False) -> None:
        self.prior = prior
        self.fixed = fixed
        self._coef: dict[str, tuple[Coef | None, Coef | None]] = {}
        self._models: dict[str, CostModel] = {}
        # Lower bounds over every instance's model, for the pruned placement search.
        self.floor = CostFloor(prior)

    def cost(self, instance: str) -> CostModel:
        return self._models.get(instance, self.prior)

    def calibrated(self, instance: str, part: str = "prefill") -> bool:
        """Whether ``instance`` reported a fit of ``part`` ("prefill" | "decode")."""
        c = self._coef.get(instance)
        return c is not None and c[0 if part == "prefill" else 1] is not None

    def observe(
        self,
        instance: str,
        prefill: Sequence[float] | None = None,
        decode: Sequence[float] | None = None,
    ) -> None:
        """The instance's latest coefficients (None: that part unchanged)."""
        if self.fixed or (prefill is None and decode is None):
            return
        old_p, old_d = self._coef.get(instance, (None, None))
        new = (_coef(prefill) or old_p, _coef(decode) or old_d)
        if new == (old_p, old_d):
            return
        self._coef[instance] = new
        self._models[instance] = model_from(self.prior, new[0], new[1])
        self.floor.set(instance, self._models[instance])

    def observe_fit(self, instance: str, fit: Any) -> None:
        """From a load report's ``fit`` (bus_schemas.load.CostFit or None)."""
        if fit is not None:
            self.observe(instance, fit.prefill, fit.decode)

    def set_model(self, instance: str, model: CostModel) -> None:
        """Use ``model`` for ``instance`` (the simulator's instances, tests)."""
        if not self.fixed:
            self._models[instance] = model
            self.floor.set(instance, model)

    def forget(self, instance: str) -> None:
        self._coef.pop(instance, None)
        self._models.pop(instance, None)
        self.floor.forget(instance)


def _coef(c: Sequence[float] | None) -> Coef | None:
    if c is None:
        return None
    if len(c) != 3 or not all(
        isinstance(v, int | float) and math.isfinite(v) and v >= 0 for v in c
    ):
        return None  # a malformed report keeps what was known
    return (float(c[0]), float(c[1]), float(c[2]))
