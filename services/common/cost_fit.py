"""A cost model fitted from profiling data (paper §4.1: the conductor "estimates the
corresponding execution time based on the request length and prefix_len ... using a
polynomial regression model fitted with offline data").

Prefill seconds are a polynomial in the input length ``n`` and the prefix hit length
``p`` (tokens), every monomial ``n**i * p**j`` with ``i + j <= degree`` (degree 2 by
default: 1, n, p, n^2, n*p, p^2), fitted by least squares (numpy) on samples
``(n, p, seconds)``. The analytic model of eq. 1 lies in that space exactly::

    t(n, p) = l * (a*d*(n^2 - p^2) + b*d^2*(n - p)) / G

so a fit of samples it generated recovers its coefficients (see
:func:`analytic_prefill_terms`). Decode step seconds can be fitted too, as
``c0 + c1*batch + c2*context``; without decode samples the analytic model stays.
Transfer time is always the analytic ``(bytes + bytes in flight) / B_nic``.

:class:`FittedCostModel` subclasses :class:`CostModel`, so it drops in wherever a
CostModel goes (policies, mock engine, simulator). ``fitted_speedup`` records how fast
the profiled system ran (its ``--speedup``): ``with_speedup(s)`` then scales the fitted
times by ``fitted_speedup / s``, so a service started with the same ``--speedup`` as the
profiled stack gets the measured seconds back.

JSON (``perigee profile --json OUT`` writes it, ``--cost-model OUT`` reads it)::

    {"format": "perigee-cost-model", "version": 1,
     "analytic": {<CostModel fields but speedup>},
     "fitted_speedup": 1.0,
     "prefill": {"vars": ["n", "p"], "terms": [[i, j, coef], ...]} | null,
     "decode": {"vars": ["batch", "context"], "terms": [[i, j, coef], ...]} | null,
     "meta": {...}}
"""

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from services.common.cost_model import CostModel

FORMAT = "perigee-cost-model"
VERSION = 1


@dataclass(frozen=True)
class PrefillSample:
    """One measured prefill: prompt tokens, reused prefix tokens and seconds."""

    n: int  # prompt tokens
    p: int  # prefix tokens whose KV was reused (not computed)
    seconds: float


@dataclass(frozen=True)
class DecodeSample:
    """One measured decode step: batch, context tokens and seconds."""

    batch: int  # running sequences
    context: float  # context tokens held by the batch, in all (a mean over steps)
    seconds: float  # one decode step


@dataclass(frozen=True)
class Poly2D:
    """``sum(c * x**i * y**j for i, j, c in terms)``."""

    terms: tuple[tuple[int, int, float], ...]

    def __call__(self, x: float, y: float) -> float:
        return math.fsum(c * x**i * y**j for i, j, c in self.terms)

    def coef(self, i: int, j: int) -> float:
        return next((c for ti, tj, c in self.terms if (ti, tj) == (i, j)), 0.0)

    def to_json(self) -> list[list[float]]:
        return [[i, j, c] for i, j, c in self.terms]

    @classmethod
    def from_json(cls, obj: Any) -> "Poly2D":
        if not isinstance(obj, list):
            raise ValueError("polynomial terms must be a list of [i, j, coef]")
        terms = []
        for t in obj:
            if not (isinstance(t, list) and len(t) == 3):
                raise ValueError(f"bad polynomial term {t!r}: want [i, j, coef]")
            i, j, c = t
            if not (isinstance(i, int) and isinstance(j, int) and i >= 0 and j >= 0):
                raise ValueError(f"bad exponents in term {t!r}")
            if not isinstance(c, int | float) or not math.isfinite(c):
                raise ValueError(f"bad coefficient in term {t!r}")
            terms.append((i, j, float(c)))
        return cls(tuple(terms))


def monomials(degree: int) -> list[tuple[int, int]]:
    """Exponents (i, j) with i + j <= degree, by total degree, x before y."""
    if degree < 0:
        raise ValueError("degree must be >= 0")
    return [(k - j, j) for k in range(degree + 1) for j in range(k + 1)]


def fit_poly2d(
    points: Iterable[tuple[float, float, float]], exponents: Sequence[tuple[int, int]]
) -> tuple[Poly2D, dict[str, float]]:
    """Least-squares fit of z over the monomials ``exponents`` of (x, y); returns the
    polynomial and fit statistics (samples, rmse_s, max_abs_err_s, max_rel_err).
    Columns are scaled to unit maximum first, so n**2 ~ 1e8 beside 1 stays well
    conditioned. Raises ValueError when the samples cannot determine every term."""
    pts = np.asarray(list(points), dtype=np.float64)
    if pts.ndim != 2 or pts.shape[0] == 0:
        raise ValueError("no samples to fit")
    if not np.all(np.isfinite(pts)):
        raise ValueError("samples must be finite numbers")
    x, y, z = pts[:, 0], pts[:, 1], pts[:, 2]
    a = np.stack([x**i * y**j for i, j in exponents], axis=1)
    scale = np.max(np.abs(a), axis=0)
    scale[scale == 0] = 1.0
    coef, _, rank, _ = np.linalg.lstsq(a / scale, z, rcond=None)
    if rank < len(exponents):
        raise ValueError(
            f"{len(pts)} samples determine only {rank} of {len(exponents)} terms: "
            "vary both variables (e.g. several prompt lengths, each with several prefix hits)"
        )
    coef = coef / scale
    poly = Poly2D(tuple((i, j, float(c)) for (i, j), c in zip(exponents, coef, strict=True)))
    pred = a @ coef
    err = np.abs(pred - z)
    rel = err / np.maximum(np.abs(z), 1e-12)
    stats = {
        "samples": float(len(pts)),
        "rmse_s": float(np.sqrt(np.mean(err**2))),
        "max_abs_err_s": float(err.max()),
        "max_rel_err": float(rel.max()),
    }
    return poly, stats


def fit_prefill(samples: Iterable[PrefillSample], degree: int = 2) -> tuple[Poly2D, dict[str, Any]]:
    return fit_poly2d(((s.n, s.p, s.seconds) for s in samples), monomials(degree))


def fit_decode(samples: Iterable[DecodeSample]) -> tuple[Poly2D, dict[str, Any]]:
    """``c0 + c1*batch + c2*context`` (the memory-bound model plus a per-sequence term)."""
    return fit_poly2d(((s.batch, s.context, s.seconds) for s in samples), monomials(1))


def analytic_prefill_terms(cost: CostModel) -> dict[tuple[int, int], float]:
    """The monomial coefficients of ``cost.prefill_time(n, p)`` (eq. 1), speedup 1."""
    k = cost.layers / cost.gpu_flops
    return {
        (2, 0): k * cost.a * cost.d,
        (1, 0): k * cost.b * cost.d * cost.d,
        (0, 2): -k * cost.a * cost.d,
        (0, 1): -k * cost.b * cost.d * cost.d,
    }


_ANALYTIC = [f.name for f in fields(CostModel) if f.name != "speedup"]


@dataclass(frozen=True)
class FittedCostModel(CostModel):
    """The cost model with prefill and decode times from fitted polynomials (eq. 1 if unfitted)."""

    prefill_fit: Poly2D | None = None  # seconds(n, p); None: the analytic eq. 1
    decode_fit: Poly2D | None = None  # seconds(batch, context); None: analytic
    fitted_speedup: float = 1.0  # the profiled system's --speedup
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def _fitted(self, seconds: float) -> float:
        if math.isinf(self.speedup):
            return 0.0
        return max(0.0, seconds) * self.fitted_speedup / self.speedup

    def prefill_time(self, n: int, prefix: int = 0) -> float:
        if self.prefill_fit is None:
            return super().prefill_time(n, prefix)
        prefix = min(max(prefix, 0), n)
        return self._fitted(self.prefill_fit(n, prefix))

    def decode_step_time(self, batch_size: float, context_tokens: float) -> float:
        if self.decode_fit is None:
            return super().decode_step_time(batch_size, context_tokens)
        if batch_size <= 0:
            return 0.0
        return self._fitted(self.decode_fit(batch_size, context_tokens))

    # ------------------------------------------------------------ JSON

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "analytic": {name: getattr(self, name) for name in _ANALYTIC},
            "fitted_speedup": self.fitted_speedup,
            "prefill": None
            if self.prefill_fit is None
            else {"vars": ["n", "p"], "terms": self.prefill_fit.to_json()},
            "decode": None
            if self.decode_fit is None
            else {"vars": ["batch", "context"], "terms": self.decode_fit.to_json()},
            "meta": self.meta,
        }

    @classmethod
    def from_json(cls, obj: Any, speedup: float = 1.0) -> "FittedCostModel":
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} document")
        if obj.get("version") != VERSION:
            raise ValueError(f"unsupported {FORMAT} version {obj.get('version')!r}")
        analytic = obj.get("analytic") or {}
        unknown = set(analytic) - set(_ANALYTIC)
        if unknown:
            raise ValueError(f"unknown analytic fields {sorted(unknown)}")
        fs = float(obj.get("fitted_speedup", 1.0))
        if not (fs > 0 and math.isfinite(fs)):
            raise ValueError("fitted_speedup must be a positive finite number")

        def poly(key: str) -> Poly2D | None:
            part = obj.get(key)
            return None if part is None else Poly2D.from_json(part.get("terms"))

        return cls(
            **analytic,
            speedup=speedup,
            prefill_fit=poly("prefill"),
            decode_fit=poly("decode"),
            fitted_speedup=fs,
            meta=dict(obj.get("meta") or {}),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path, speedup: float = 1.0) -> "FittedCostModel":
        return cls.from_json(json.loads(Path(path).read_text()), speedup=speedup)


def fit_cost_model(
    prefill: Iterable[PrefillSample],
    decode: Iterable[DecodeSample] = (),
    *,
    base: CostModel | None = None,
    degree: int = 2,
    fitted_speedup: float = 1.0,
    meta: dict[str, Any] | None = None,
) -> FittedCostModel:
    """Fit prefill (and decode, if samples are given) over ``base``'s analytic model."""
    base = base or CostModel()
    pfit, pstats = fit_prefill(prefill, degree)
    dsamples = list(decode)
    dfit, dstats = fit_decode(dsamples) if dsamples else (None, None)
    info = {"degree": degree, "prefill_fit": pstats, **(meta or {})}
    if dstats is not None:
        info["decode_fit"] = dstats
    analytic = {name: getattr(base, name) for name in _ANALYTIC}
    return FittedCostModel(
        **analytic,
        prefill_fit=pfit,
        decode_fit=dfit,
        fitted_speedup=fitted_speedup,
        meta=info,
    )


def load_cost_model(path: str | Path | None, speedup: float = 1.0) -> CostModel:
    """The services' ``--cost-model PATH``: a fitted model, or the analytic default."""
    if not path:
        return CostModel().with_speedup(speedup)
    return FittedCostModel.load(path, speedup=speedup)
