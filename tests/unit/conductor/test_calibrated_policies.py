"""Placement, admission and the P/D controller estimate each instance with the fit it
reports on its load reports (services.common.calibration.CalibrationBook), and keep
the prior for instances that report none or when the model is hand-given (fixed)."""

import pytest

from bus_schemas.load import CostFit, DecodeLoad, PrefillLoad
from services.admission.admission_policy import (
    AdmissionRequest,
    EarlyRejectionPolicy,
    PredictiveRejectionPolicy,
)
from services.common.calibration import CalibrationBook, decode_features, prefill_features
from services.common.clock import ManualClock
from services.common.cost_model import CostModel
from services.conductor.pd_ratio import PDRatioController
from services.conductor.placement_policy import Placement, PlacementPolicy, PlacementRequest

BS = 32
PRIOR = CostModel(speedup=100.0)
FAST = (0.01, 1e-4, 1e-8)
SLOW = (0.05, 5e-4, 5e-8)  # five times FAST
DEC = (0.02, 1e-3, 1e-6)


def t_prefill(c, n: int, p: int = 0) -> float:
    return sum(a * b for a, b in zip(c, prefill_features(n, p), strict=True))


def t_step(d, b: float, ctx: float) -> float:
    return sum(a * x for a, x in zip(d, decode_features(b, ctx), strict=True))


def pload(inst: str, node: str, work: float = 0.0, fit=None) -> PrefillLoad:
    return PrefillLoad(
        instance=inst,
        node=node,
        queue_len=0,
        queued_tokens=0,
        queued_work_s=work,
        ts=0.0,
        fit=None if fit is None else CostFit(prefill=list(fit), prefill_samples=9),
    )


def dload(inst: str, node: str, batch: int = 0, kv: int = 0, fit=None) -> DecodeLoad:
    return DecodeLoad(
        instance=inst,
        node=node,
        batch_size=batch,
        waiting=0,
        max_batch=64,
        kv_tokens=kv,
        step_time_s=0.0,
        ts=0.0,
        fit=None if fit is None else CostFit(decode=list(fit), decode_samples=9),
    )


def req(n: int = 1000) -> PlacementRequest:
    return PlacementRequest(request_id="r", num_tokens=n, block_hashes=(), block_size=BS)


def test_placement_estimates_each_instance_with_its_own_fit():
    pol = PlacementPolicy(ManualClock(0.0), PRIOR, ttft_slo_s=100.0, tbt_slo_s=100.0)
    pol.observe_prefill(pload("slow", "n0", fit=SLOW))
    pol.observe_prefill(pload("fast", "n1", work=0.02, fit=FAST))
    pol.observe_decode(dload("d0", "m0", batch=3, kv=3000, fit=DEC))
    d = pol.place(req(1000), {})
    assert isinstance(d, Placement)
    assert d.prefill_instance == "fast"  # 0.02 queued + 0.12 beats 0.6 on the slow one
    assert d.est_prefill_s == pytest.approx(t_prefill(FAST, 1000))
    assert d.est_ttft_s == pytest.approx(0.02 + t_prefill(FAST, 1000))
    assert d.est_tbt_s == pytest.approx(t_step(DEC, 4, 4000))


def test_decode_placement_balances_instances_whose_fits_differ_by_noise():
    # Two alike decode instances whose calibrations came out 1 % apart: min-TBT would
    # send every request to the faster one; within the TBT SLO they must share the load.
    flat = (0.02, 1e-6, 1e-9)  # steps barely grow with the batch, as on the mock or a GPU
    noisy = tuple(c * 1.01 for c in flat)
    pol = PlacementPolicy(ManualClock(0.0), PRIOR, ttft_slo_s=100.0, tbt_slo_s=1.0)
    pol.observe_prefill(pload("p0", "n0"))
    pol.observe_decode(dload("d0", "m0", fit=noisy))
    pol.observe_decode(dload("d1", "m1", fit=flat))
    picks = []
    for i in range(6):
        d = pol.place(
            PlacementRequest(request_id=f"r{i}", num_tokens=100, block_hashes=(), block_size=BS), {}
        )
        picks.append(d.decode_instance)
    assert picks.count("d0") == 3 and picks.count("d1") == 3, picks


def test_decode_placement_skips_an_instance_over_the_tbt_slo():
    # busy: 0.052 s per step with one more request; idle-but-slow: 0.21 s.
    pol = PlacementPolicy(ManualClock(0.0), PRIOR, ttft_slo_s=100.0, tbt_slo_s=0.1)
    pol.observe_prefill(pload("p0", "n0"))
    pol.observe_decode(dload("idle-but-slow", "m0", fit=tuple(c * 10 for c in DEC)))
    pol.observe_decode(dload("busy", "m1", batch=30, kv=1000, fit=DEC))
    assert pol.place(req(100), {}).decode_instance == "busy"


def test_placement_keeps_the_prior_for_silent_instances_and_when_fixed():
    fixed = CalibrationBook(PRIOR, fixed=True)
    for book, want in ((None, t_prefill(SLOW, 1000)), (fixed, PRIOR.prefill_time(1000))):
        pol = PlacementPolicy(ManualClock(0.0), PRIOR, ttft_slo_s=100.0, tbt_slo_s=100.0, book=book)
        pol.observe_prefill(pload("p0", "n0", fit=SLOW))
        pol.observe_decode(dload("d0", "m0"))
        d = pol.place(req(1000), {})
        assert d.est_prefill_s == pytest.approx(want)
    pol = PlacementPolicy(ManualClock(0.0), PRIOR, ttft_slo_s=100.0, tbt_slo_s=100.0)
    pol.observe_prefill(pload("p0", "n0"))
    pol.observe_decode(dload("d0", "m0"))
    assert pol.place(req(1000), {}).est_prefill_s == pytest.approx(PRIOR.prefill_time(1000))


def test_early_rejection_uses_each_decode_instance_fit():
    pol = EarlyRejectionPolicy(ManualClock(0.0), PRIOR, ttft_slo_s=10.0, tbt_slo_s=0.05)
    pol.observe_prefill(pload("p0", "n0"))
    pol.observe_decode(dload("d0", "m0", batch=10, kv=10_000, fit=DEC))
    load = pol.decode_load(AdmissionRequest("r", 1000))
    assert load == pytest.approx(t_step(DEC, 11, 11_000) / 0.05)


def test_predict_finishes_the_prefill_on_the_instance_that_is_first_done():
    clock = ManualClock(0.0)
    pol = PredictiveRejectionPolicy(clock, PRIOR, ttft_slo_s=10.0, tbt_slo_s=1.0)
    pol.observe_prefill(pload("slow", "n0", fit=SLOW))
    pol.observe_prefill(pload("fast", "n1", work=0.1, fit=FAST))
    pol.observe_decode(dload("d0", "m0", fit=DEC))
    r = AdmissionRequest("r", 2000)
    assert pol.prefill_done_at(r) == pytest.approx(0.1 + t_prefill(FAST, 2000))
    pol.on_accepted(r)
    assert pol.admitted["r"].work_s == pytest.approx(t_prefill(FAST, 2000))


def test_pd_controller_uses_a_decode_instance_fitted_tbt():
    book = CalibrationBook(PRIOR)
    pd = PDRatioController(ManualClock(0.0), book=book, min_samples=1)
    book.observe("d0", decode=DEC)
    pd.observe_decode(dload("d0", "m0", batch=4, kv=2000), tbt_slo_s=0.1)
    pd.observe_decode(dload("d1", "m1", batch=4, kv=2000), tbt_slo_s=0.1)  # no fit: step_time_s
    assert pd._latest["decode"]["d0"] == pytest.approx(t_step(DEC, 4, 2000) / 0.1)
    assert pd._latest["decode"]["d1"] == 0.0
