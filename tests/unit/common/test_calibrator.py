"""The worker's side of calibration: the warm-up feeds the instance's fit through the
Engine interface, load reports carry the fit and what was measured since the last
one, and the fit kept on disk is the next start's prior."""

import pytest

from bus_schemas.load import DecodeLoad, PrefillLoad
from services.common import calibrator as calibration
from services.common.calibration import OnlineFit
from services.common.calibrator import Calibrator
from services.common.cost_fit import FittedCostModel
from services.common.cost_model import CostModel
from services.common.kv_layout import KVLayout
from services.common.model_spec import DEFAULT_MODEL_DIR, ModelSpec
from services.engine.mock import MockEngine
from services.worker.warmup import LONG_DECODE, warm_up

SPEC = ModelSpec.from_dir(None)
LAYOUT = KVLayout(SPEC, 32)


def pload() -> PrefillLoad:
    return PrefillLoad(
        instance="p", node="n", queue_len=0, queued_tokens=0, queued_work_s=0.0, ts=0.0
    )


async def test_warm_up_feeds_prefill_and_decode_samples_through_the_engine():
    engine = MockEngine(SPEC, CostModel(speedup=float("inf")), max_batch=8)
    calib = Calibrator(OnlineFit(CostModel()))
    engine.on_decode_step = calib.decode_step
    await engine.start()
    try:
        await warm_up(engine, LAYOUT, calib, ("prefill", "decode"), 6)
    finally:
        await engine.stop()
    assert calib.fit.prefill_samples == 7  # six lengths and one with a reused prefix
    # four requests decoding side by side, finishing one after another: every batch size
    batches = {b for b, _, _ in calib._steps}
    assert batches == {1, 2, 3, 4}
    # and one long request alone, so context and batch size do not move together
    assert any(b == 1 and ctx >= LONG_DECODE for b, ctx, _ in calib._steps)


def test_reports_carry_the_fit_and_the_fresh_measurements_once():
    calib = Calibrator(OnlineFit(CostModel()))
    plain = calib.annotate(pload())
    assert plain.fit.prefill is None and plain.fit.decode is None and plain.measured == []
    calib.prefill(1000, 0, 0.5, predicted=0.25)
    calib.prefill(2000, 1024, 0.6)
    calib.decode_step(3, 900, 0.02)
    r = calib.annotate(pload())
    assert r.measured == [(1000, 0, 0.5), (2000, 1024, 0.6)]
    assert r.fit.prefill == list(calib.fit.prefill_coef()) and r.fit.prefill_samples == 2
    assert r.fit.decode == list(calib.fit.decode_coef())
    assert calib.annotate(pload()).measured == []
    d = calib.annotate(
        DecodeLoad(
            instance="d",
            node="n",
            batch_size=0,
            waiting=0,
            max_batch=8,
            kv_tokens=0,
            step_time_s=0.0,
            ts=0.0,
        )
    )
    assert d.measured == [(3, 900, 0.02)]


def test_fit_kept_on_disk_is_the_next_prior(tmp_path, monkeypatch):
    monkeypatch.setenv("PERIGEE_CACHE_DIR", str(tmp_path))
    prior = CostModel(speedup=100.0)
    first = calibration.for_worker("mock", DEFAULT_MODEL_DIR, SPEC.name, prior, 1.0)
    assert first.fit.prior is prior and first.path.parent == tmp_path / "fits"
    for n in (100, 400, 1600, 3000):
        first.prefill(n, 0, 0.01 + 1e-4 * n)
    first.save()
    again = calibration.for_worker("mock", DEFAULT_MODEL_DIR, SPEC.name, prior, 1.0)
    assert isinstance(again.fit.prior, FittedCostModel)
    assert again.model().prefill_time(1600) == pytest.approx(first.model().prefill_time(1600))
    assert again.cost_fit().prefill is not None  # reported before any new sample
    # another engine speed is another machine: its own file
    other = calibration.for_worker("mock", DEFAULT_MODEL_DIR, SPEC.name, prior, 2.0)
    assert other.path != first.path and other.fit.prior is prior


def test_a_mature_fit_is_refitted_at_most_every_interval():
    now = [0.0]
    c = Calibrator(OnlineFit(CostModel()), clock=lambda: now[0])
    for _ in range(calibration.YOUNG_SAMPLES):  # young: every sample refits at once
        c.prefill(1000, 0, 1.0)
        assert c.model().prefill_time(1000, 0) == pytest.approx(1.0, rel=0.05)
    for _ in range(20):  # the machine got 3x slower, but the fit is mature
        c.prefill(1000, 0, 3.0)
    assert c.model().prefill_time(1000, 0) == pytest.approx(1.0, rel=0.05)
    assert c.cost_fit().prefill_samples == calibration.YOUNG_SAMPLES
    now[0] += calibration.REFIT_INTERVAL_S
    assert c.model().prefill_time(1000, 0) > 1.2  # refitted: it moves toward the slowdown
    assert c.cost_fit().prefill_samples == calibration.YOUNG_SAMPLES + 20
