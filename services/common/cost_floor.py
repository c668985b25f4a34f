"""Lower bounds on what any instance's cost model predicts, kept as instances' models
change: a pruned placement search (services.conductor.placement_policy) stops looking once even
the fastest conceivable instance could not beat the best one found.

Pure. :class:`CostFloor` belongs to a :class:`~services.common.calibration.CalibrationBook`
and is told of every instance's model. A model fitted from load reports has the form
``c0 + c1 (n - p) + c2 (n^2 - p^2)`` (prefill) and ``d0 + d1 batch + d2 context``
(decode step) with non-negative coefficients (the book refuses others), so the
polynomial of the per-coefficient minima bounds every such model from below; each
coefficient's minimum comes from an ordered multiset, O(log n) per change. The prior
(and the analytic form with its constants, which a model fitted for one part only keeps
for the other) is evaluated as it is; any other model (``set_model``) is evaluated as
it is for prefill, and disables the decode bound (no shape is known for it).

Bounds are shaded by ``SHADE`` below the exact arithmetic so that rounding in a
different order of operations never lifts a bound above the value it bounds.
"""

import math
from collections import Counter
from typing import Any

from sortedcontainers import SortedList

from services.common.cost_fit import FittedCostModel, Poly2D
from services.common.cost_model import CostModel

SHADE = 1.0 - 1e-9
_PREFILL_FORM = ((0, 0), (1, 0), (0, 1), (2, 0), (0, 2))
_DECODE_FORM = ((0, 0), (1, 0), (0, 1))


def _prefill_coef(poly: Poly2D | None) -> tuple[float, float, float] | None:
    """(c0, c1, c2) of a fitted prefill of the reported form with c >= 0, else None."""
    if poly is None or tuple((i, j) for i, j, _ in poly.terms) != _PREFILL_FORM:
        return None
    c0, c1, c2 = poly.coef(0, 0), poly.coef(1, 0), poly.coef(2, 0)
    if min(c0, c1, c2) < 0 or poly.coef(0, 1) != -c1 or poly.coef(0, 2) != -c2:
        return None
    return (c0, c1, c2)


def prefill_coefs(model: CostModel) -> tuple[float, float, float] | None:
    """(e0, e1, e2) such that ``model.prefill_time(n, p)`` is ``e0 + e1 (n - p) + e2 (n^2 -
    p^2)`` (the fit's coefficients in measured seconds, scaled as ``_fitted`` scales
    them), for a fitted prefill of the reported form; None for any other model."""
    if not isinstance(model, FittedCostModel):
        return None
    c = _prefill_coef(model.prefill_fit)
    if c is None:
        return None
    if math.isinf(model.speedup):
        return (0.0, 0.0, 0.0)
    s = model.fitted_speedup / model.speedup
    return (c[0] * s, c[1] * s, c[2] * s)


def _decode_coef(poly: Poly2D | None) -> tuple[float, float, float] | None:
    if poly is None or tuple((i, j) for i, j, _ in poly.terms) != _DECODE_FORM:
        return None
    d = (poly.coef(0, 0), poly.coef(1, 0), poly.coef(0, 1))
    return d if min(d) >= 0 else None


class CostFloor:
    """The cheapest any instance's cost model could predict, kept as the models change."""

    def __init__(self, prior: CostModel) -> None:
        self.prior = prior
        self._analytic = CostModel(
            **{f: getattr(prior, f) for f in CostModel.__dataclass_fields__ if f != "speedup"},
            speedup=prior.speedup,
        )
        self._coefs = [SortedList() for _ in range(6)]  # c0, c1, c2, d0, d1, d2
        self._sig: dict[str, tuple[Any, ...]] = {}  # instance -> what it added
        self._others: Counter[int] = Counter()  # id(model) -> instances using it
        self._other_models: dict[int, CostModel] = {}
        self._no_decode_shape = 0  # instances whose decode has no known shape
        self._floor_model: CostModel | None = None  # cached min-coefficient model
        self._fitted_prefill = 0
        self._fitted_decode = 0
        # Instances whose model changed since the search last looked (it drains this to
        # keep its prefill coefficient orders, services.conductor.search.FitOrders).
        self.changed: set[str] = set()

    # ------------------------------------------------------------ updates

    def set(self, instance: str, model: CostModel | None) -> None:
        """``instance`` now predicts with ``model`` (None: the prior)."""
        self.forget(instance)
        self.changed.add(instance)
        if model is None or model is self.prior:
            return
        pc = dc = None
        other = False
        if isinstance(model, FittedCostModel) and self._same_constants(model):
            pc = _prefill_coef(model.prefill_fit)
            dc = _decode_coef(model.decode_fit)
            other = (model.prefill_fit is not None and pc is None) or (
                model.decode_fit is not None and dc is None
            )
        else:
            other = True
        if other:
            self._others[id(model)] += 1
            self._other_models[id(model)] = model
            self._no_decode_shape += 1
            self._sig[instance] = ("other", id(model))
            self._floor_model = None
            return
        for k, v in enumerate(pc or ()):
            self._coefs[k].add(v)
        for k, v in enumerate(dc or ()):
            self._coefs[3 + k].add(v)
        self._fitted_prefill += pc is not None
        self._fitted_decode += dc is not None
        self._sig[instance] = ("fit", pc, dc)
        self._floor_model = None

    def forget(self, instance: str) -> None:
        self.changed.add(instance)
        sig = self._sig.pop(instance, None)
        if sig is None:
            return
        self._floor_model = None
        if sig[0] == "other":
            key = sig[1]
            self._others[key] -= 1
            self._no_decode_shape -= 1
            if self._others[key] <= 0:
                del self._others[key]
                del self._other_models[key]
            return
        _, pc, dc = sig
        for k, v in enumerate(pc or ()):
            self._coefs[k].remove(v)
        for k, v in enumerate(dc or ()):
            self._coefs[3 + k].remove(v)
        self._fitted_prefill -= pc is not None
        self._fitted_decode -= dc is not None

    def _same_constants(self, m: CostModel) -> bool:
        return all(
            getattr(m, f) == getattr(self.prior, f)
            for f in ("layers", "d", "a", "b", "gqa", "elem_bytes", "gpu_flops", "speedup")
            + ("weight_bytes", "hbm_bw", "decode_seq_s")
        )

    @property
    def uniform(self) -> bool:
        """No instance predicts with a model of its own: every one uses the prior, so
        equal inputs give every instance equal times."""
        return not self._sig

    # ------------------------------------------------------------ bounds

    def _min_model(self) -> CostModel:
        """The reported forms with every coefficient at its minimum, built as
        services.common.calibration.model_from builds an instance's model."""
        if self._floor_model is None:
            a = self._analytic
            pf = df = None
            if self._fitted_prefill:
                c0, c1, c2 = (s[0] for s in self._coefs[:3])
                pf = Poly2D(((0, 0, c0), (1, 0, c1), (0, 1, -c1), (2, 0, c2), (0, 2, -c2)))
            if self._fitted_decode:
                d0, d1, d2 = (s[0] for s in self._coefs[3:])
                df = Poly2D(((0, 0, d0), (1, 0, d1), (0, 1, d2)))
            self._floor_model = FittedCostModel(
                **{f: getattr(a, f) for f in CostModel.__dataclass_fields__},
                prefill_fit=pf,
                decode_fit=df,
                fitted_speedup=a.speedup if math.isfinite(a.speedup) else 1.0,
            )
        return self._floor_model

    def prefill(self, n: int, prefix: int) -> float:
        """At most the prefill time of (``n``, ``prefix``) on any instance."""
        t = min(self.prior.prefill_time(n, prefix), self._analytic.prefill_time(n, prefix))
        if self._fitted_prefill:
            t = min(t, self._min_model().prefill_time(n, prefix))
        for m in self._other_models.values():
            t = min(t, m.prefill_time(n, prefix))
        return t * SHADE

    def prefill_unfitted(self, n: int, prefix: int) -> float:
        """At most the prefill time of (``n``, ``prefix``) on any instance whose model is
        not a fitted prefill of the reported form (the prior, the analytic form, any
        other model): :meth:`prefill` without the fits' coefficient floor."""
        t = min(self.prior.prefill_time(n, prefix), self._analytic.prefill_time(n, prefix))
        for m in self._other_models.values():
            t = min(t, m.prefill_time(n, prefix))
        return t * SHADE

    def tbt(self, context_tokens: int, rounds: int = 1) -> float:
        """At most the TBT of any instance whose sequences hold ``context_tokens`` in all
        and take at least ``rounds`` steps per token (``CostModel.decode_tbt``: past the
        batch cap, ``ceil(batch / max_batch)``), whatever its batch; -inf when some
        model's shape is unknown. ``rounds`` steps of a model ``c + b batch + k
        context`` cost ``rounds c + b batch + k context``: the bound keeps the first and
        the last term."""
        if self._no_decode_shape:
            return -math.inf
        prior = self.prior
        if isinstance(prior, FittedCostModel) and prior.decode_fit is not None:
            d = _decode_coef(prior.decode_fit)
            if d is None:
                return -math.inf
            t = prior._fitted(rounds * d[0] + d[2] * context_tokens)
        else:
            t = self._step_floor(prior, context_tokens, rounds)
        t = min(t, self._step_floor(self._analytic, context_tokens, rounds))
        if self._fitted_decode:
            m = self._min_model()
            assert isinstance(m, FittedCostModel) and m.decode_fit is not None
            d = _decode_coef(m.decode_fit)
            assert d is not None
            t = min(t, m._fitted(rounds * d[0] + d[2] * context_tokens))
        return t * SHADE

    @staticmethod
    def _step_floor(m: CostModel, context_tokens: int, rounds: int = 1) -> float:
        """The analytic steps without the per-sequence term: a batch only adds to it."""
        return m._scale((rounds * m.weight_bytes + m.kv_bytes(context_tokens)) / m.hbm_bw)
