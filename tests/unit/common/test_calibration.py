"""The online fitter (services.common.calibration): eq. 1's form plus a fixed cost,
fitted robustly toward a prior, one model per instance, and the consumers' book."""

import math

import numpy as np
import pytest

from bus_schemas.codec import decode, encode
from bus_schemas.load import CostFit, PrefillLoad
from services.common.calibration import (
    CalibrationBook,
    OnlineFit,
    decode_features,
    fit_form,
    model_from,
    prefill_features,
    prior_decode,
    prior_prefill,
)
from services.common.cost_fit import FittedCostModel, analytic_prefill_terms
from services.common.cost_model import CostModel

TRUE_P = (0.02, 2e-4, 5e-8)  # 20 ms fixed, 0.2 ms/token, quadratic attention
TRUE_D = (0.004, 3e-4, 2e-7)


def t_prefill(n: int, p: int = 0, c=TRUE_P) -> float:
    return float(np.dot(prefill_features(n, p), c))


def t_decode(b: int, ctx: int, d=TRUE_D) -> float:
    return float(np.dot(decode_features(b, ctx), d))


def mixed(k: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(k):
        n = int(rng.integers(32, 3000))
        out.append((n, int(rng.integers(0, n // 2)) // 32 * 32))
    return out


def test_prior_coefficients_are_eq1_exactly():
    cost = CostModel()
    terms = analytic_prefill_terms(cost)
    c0, c1, c2 = prior_prefill(cost)
    assert c0 == pytest.approx(0.0, abs=1e-12)
    assert c1 == pytest.approx(terms[(1, 0)], rel=1e-6)
    assert c2 == pytest.approx(terms[(2, 0)], rel=1e-6)
    d0, d1, d2 = prior_decode(cost)
    assert d0 == pytest.approx(cost.weight_bytes / cost.hbm_bw, rel=1e-6)
    assert d1 == pytest.approx(0.0, abs=1e-12)
    assert d2 == pytest.approx(cost.kv_bytes(1) / cost.hbm_bw, rel=1e-6)


def test_zero_samples_give_the_prior():
    cost = CostModel(speedup=100.0)
    fit = OnlineFit(cost)
    m = fit.model()
    for n, p in [(100, 0), (3000, 1024), (8000, 0)]:
        assert m.prefill_time(n, p) == pytest.approx(cost.prefill_time(n, p), rel=1e-6)
    assert m.decode_step_time(8, 4000) == pytest.approx(cost.decode_step_time(8, 4000), rel=1e-6)
    assert fit_form(np.zeros((0, 3)), np.zeros(0), (1.0, 2.0, 3.0)) == (1.0, 2.0, 3.0)


def test_one_sample_keeps_the_prior_shape_at_the_measured_speed():
    cost = CostModel()  # A800: far faster than the "machine" below
    fit = OnlineFit(cost)
    fit.add_prefill(1000, 0, 50 * cost.prefill_time(1000))
    m = fit.model()
    assert m.prefill_time(1000) == pytest.approx(50 * cost.prefill_time(1000), rel=1e-3)
    assert m.prefill_time(4000, 1000) == pytest.approx(50 * cost.prefill_time(4000, 1000), rel=1e-2)


def test_recovers_known_coefficients_from_clean_samples():
    fit = OnlineFit(CostModel())
    for n, p in mixed(40):
        fit.add_prefill(n, p, t_prefill(n, p))
    for got, want in zip(fit.prefill_coef(), TRUE_P, strict=True):
        assert got == pytest.approx(want, rel=0.01)
    for b in (1, 2, 4, 8, 16, 32):
        for ctx in (100 * b, 900 * b):
            fit.add_decode(b, ctx, t_decode(b, ctx))
    for got, want in zip(fit.decode_coef(), TRUE_D, strict=True):
        assert got == pytest.approx(want, rel=0.01)


def test_an_outlier_barely_moves_the_fit():
    fit = OnlineFit(CostModel())
    samples = mixed(30)
    for i, (n, p) in enumerate(samples):
        fit.add_prefill(n, p, t_prefill(n, p) * (10.0 if i == 25 else 1.0))
    m = fit.model()
    for n, p in [(64, 0), (1000, 0), (3000, 1024)]:
        assert m.prefill_time(n, p) == pytest.approx(t_prefill(n, p), rel=0.01)


def test_follows_a_machine_that_slows_down():
    fit = OnlineFit(CostModel(), half_life=8)
    for n, p in mixed(30, seed=1):
        fit.add_prefill(n, p, t_prefill(n, p))
    slow = tuple(3 * c for c in TRUE_P)
    for n, p in mixed(40, seed=2):
        fit.add_prefill(n, p, t_prefill(n, p, slow))
    assert fit.model().prefill_time(2000) == pytest.approx(t_prefill(2000, 0, slow), rel=0.02)


def test_coefficients_are_never_negative():
    fit = OnlineFit(CostModel())
    # Long prompts measured faster than short ones (a noisy, nonsensical machine).
    for n, s in [(100, 0.5), (200, 0.4), (400, 0.3), (800, 0.2), (1600, 0.1)]:
        fit.add_prefill(n, 0, s)
    assert all(c >= 0 for c in fit.prefill_coef())
    assert all(fit.model().prefill_time(n) >= 0 for n in (1, 100, 5000))


def test_no_information_is_ignored():
    fit = OnlineFit(CostModel())
    fit.add_prefill(100, 100, 1.0)  # nothing computed
    fit.add_prefill(100, 0, math.nan)
    fit.add_decode(0, 0, 0.1)
    assert (fit.prefill_samples, fit.decode_samples) == (0, 0)


def test_model_from_keeps_transfer_and_speedup_of_the_prior():
    prior = CostModel(speedup=100.0)
    m = model_from(prior, TRUE_P, None)
    assert isinstance(m, FittedCostModel)
    assert m.prefill_time(2000, 512) == pytest.approx(t_prefill(2000, 512))
    assert m.decode_step_time(4, 1000) == pytest.approx(prior.decode_step_time(4, 1000))
    assert m.transfer_time(1000) == pytest.approx(prior.transfer_time(1000))
    # A persisted fit is a valid prior: saved and loaded, it predicts the same.
    again = FittedCostModel.from_json(m.to_json(), speedup=100.0)
    assert again.prefill_time(2000, 512) == pytest.approx(t_prefill(2000, 512))
    assert prior_prefill(again) == pytest.approx(TRUE_P, rel=1e-6)


def test_one_model_per_instance_in_the_book():
    prior = CostModel(speedup=100.0)
    book = CalibrationBook(prior)
    slow = tuple(4 * c for c in TRUE_P)
    book.observe("prefill-0", prefill=TRUE_P)
    book.observe("prefill-1", prefill=slow)
    assert book.cost("prefill-0").prefill_time(1000) == pytest.approx(t_prefill(1000))
    assert book.cost("prefill-1").prefill_time(1000) == pytest.approx(4 * t_prefill(1000))
    assert book.cost("prefill-2") is prior
    assert book.calibrated("prefill-0") and not book.calibrated("prefill-0", "decode")
    # a decode fit of the same (switchable) instance keeps its prefill fit
    book.observe("prefill-0", decode=TRUE_D)
    assert book.cost("prefill-0").prefill_time(1000) == pytest.approx(t_prefill(1000))
    assert book.cost("prefill-0").decode_step_time(2, 500) == pytest.approx(t_decode(2, 500))
    book.forget("prefill-1")
    assert book.cost("prefill-1") is prior


def test_book_from_a_load_report_on_the_wire():
    book = CalibrationBook(CostModel())
    load = decode(
        encode(
            PrefillLoad(
                instance="p",
                node="n",
                queue_len=0,
                queued_tokens=0,
                queued_work_s=0.0,
                ts=0.0,
                fit=CostFit(prefill=list(TRUE_P), prefill_samples=7),
                measured=[(1000, 0, 0.3)],
            )
        ),
        PrefillLoad,
    )
    book.observe_fit(load.instance, load.fit)
    assert book.cost("p").prefill_time(1000) == pytest.approx(t_prefill(1000))
    book.observe("p", prefill=[-1.0, 0.0, 0.0])  # malformed: ignored
    assert book.cost("p").prefill_time(1000) == pytest.approx(t_prefill(1000))


def test_fixed_book_ignores_reports():
    given = CostModel(speedup=7.0)
    book = CalibrationBook(given, fixed=True)
    book.observe("p", prefill=TRUE_P)
    assert book.cost("p") is given
