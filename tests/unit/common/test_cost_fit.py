"""The fitted cost model: least squares recovers the analytic model's coefficients from
samples it generated; the fitted model is a drop-in CostModel and round-trips JSON;
``perigee profile`` collects exact samples when time is a ManualClock."""

import asyncio
import json
import math

import pytest

from perigee import profile
from services.common.clock import ManualClock
from services.common.cost_fit import (
    DecodeSample,
    FittedCostModel,
    Poly2D,
    PrefillSample,
    analytic_prefill_terms,
    fit_cost_model,
    fit_decode,
    fit_prefill,
    load_cost_model,
    monomials,
)
from services.common.cost_model import CostModel
from services.common.kv_layout import KVLayout
from services.common.model_spec import ModelSpec
from services.engine import make_engine

COST = CostModel()
GRID = [(n, p) for n in (256, 512, 1024, 2048, 4096) for p in (0, n // 4, n // 2, 3 * n // 4)]


def analytic_samples(cost=COST, overhead=0.0):
    return [PrefillSample(n, p, cost.prefill_time(n, p) + overhead) for n, p in GRID]


def test_monomials_of_degree_two():
    assert monomials(2) == [(0, 0), (1, 0), (0, 1), (2, 0), (1, 1), (0, 2)]
    assert monomials(0) == [(0, 0)]


def test_fit_recovers_the_analytic_coefficients():
    poly, stats = fit_prefill(analytic_samples())
    want = analytic_prefill_terms(COST)
    for i, j in monomials(2):
        got = poly.coef(i, j)
        if (i, j) in want:
            assert got == pytest.approx(want[(i, j)], rel=1e-9)
        else:  # constant and n*p: zero in eq. 1, relative to the model's scale
            scale = abs(want[(1, 0)]) * 4096
            assert abs(got) * (4096 ** (i + j) if i + j else 1) < 1e-9 * scale
    assert stats["samples"] == len(GRID)
    assert stats["max_rel_err"] < 1e-9


def test_fit_recovers_a_constant_overhead():
    poly, _ = fit_prefill(analytic_samples(overhead=0.004))
    assert poly.coef(0, 0) == pytest.approx(0.004, rel=1e-9)
    assert poly.coef(2, 0) == pytest.approx(analytic_prefill_terms(COST)[(2, 0)], rel=1e-9)


def test_fitted_model_is_a_drop_in_cost_model():
    m = fit_cost_model(analytic_samples())
    assert isinstance(m, CostModel)
    for n, p in [(100, 0), (3000, 1000), (8000, 7999), (50, 80)]:
        assert m.prefill_time(n, p) == pytest.approx(COST.prefill_time(n, p), rel=1e-9, abs=1e-15)
    # decode / transfer / sizes stay analytic without decode samples
    assert m.decode_step_time(4, 1000) == COST.decode_step_time(4, 1000)
    assert m.transfer_time(640, 1e6) == COST.transfer_time(640, 1e6)
    assert m.kv_bytes(10) == COST.kv_bytes(10)
    fast = m.with_speedup(10.0)
    assert fast.prefill_time(3000, 1000) == pytest.approx(
        COST.prefill_time(3000, 1000) / 10, rel=1e-9
    )
    assert m.with_speedup(math.inf).prefill_time(3000, 0) == 0.0


def test_fitted_speedup_gives_measured_seconds_back_at_the_same_speedup():
    # Samples measured on a stack running at speedup 100.
    measured = [PrefillSample(n, p, COST.with_speedup(100).prefill_time(n, p)) for n, p in GRID]
    m = fit_cost_model(measured, fitted_speedup=100.0)
    at_100 = m.with_speedup(100.0)
    assert at_100.prefill_time(2048, 512) == pytest.approx(
        COST.with_speedup(100).prefill_time(2048, 512), rel=1e-9
    )
    assert m.prefill_time(2048, 512) == pytest.approx(COST.prefill_time(2048, 512), rel=1e-9)


def test_decode_step_time_depends_on_batch_and_context():
    cost = CostModel(decode_seq_s=1e-4)
    assert cost.decode_step_time(0, 100) == 0.0
    assert cost.decode_step_time(8, 1000) == pytest.approx(
        CostModel().decode_step_time(8, 1000) + 8e-4, rel=1e-12
    )
    assert CostModel().decode_step_time(8, 1000) == CostModel().decode_step_time(
        1, 1000
    )  # default: memory-bound
    samples = [
        DecodeSample(b, c, cost.decode_step_time(b, c))
        for b in (1, 4, 16, 64)
        for c in (100, 5000, 40000)
    ]
    poly, _ = fit_decode(samples)
    assert poly.coef(1, 0) == pytest.approx(1e-4, rel=1e-9)
    assert poly.coef(0, 1) == pytest.approx(cost.kv_bytes(1) / cost.hbm_bw, rel=1e-9)
    assert poly.coef(0, 0) == pytest.approx(cost.weight_bytes / cost.hbm_bw, rel=1e-9)
    m = fit_cost_model(analytic_samples(), samples)
    assert m.decode_step_time(10, 2000) == pytest.approx(cost.decode_step_time(10, 2000), rel=1e-9)
    assert m.decode_step_time(0, 2000) == 0.0


def test_json_round_trip(tmp_path):
    m = fit_cost_model(
        analytic_samples(),
        [DecodeSample(b, c, 0.01 + b * 1e-4 + c * 1e-8) for b in (1, 8) for c in (10, 1000)],
        base=CostModel(layers=40),
        fitted_speedup=2.0,
        meta={"source": "test"},
    )
    path = tmp_path / "cm.json"
    m.save(path)
    back = FittedCostModel.load(path)
    assert back == m
    assert back.layers == 40 and back.fitted_speedup == 2.0
    assert back.meta["source"] == "test" and back.meta["degree"] == 2
    assert load_cost_model(path, speedup=4.0) == m.with_speedup(4.0)
    assert load_cost_model(None, speedup=3.0) == CostModel(speedup=3.0)
    assert type(load_cost_model("", speedup=1.0)) is CostModel


@pytest.mark.parametrize(
    "doc, msg",
    [
        ({"format": "other"}, "not a perigee-cost-model"),
        ({"format": "perigee-cost-model", "version": 9}, "unsupported"),
        (
            {"format": "perigee-cost-model", "version": 1, "analytic": {"bogus": 1}},
            "unknown analytic",
        ),
        (
            {"format": "perigee-cost-model", "version": 1, "prefill": {"terms": [[1, 0]]}},
            "bad polynomial term",
        ),
        (
            {"format": "perigee-cost-model", "version": 1, "prefill": {"terms": [[-1, 0, 1.0]]}},
            "bad exponents",
        ),
        ({"format": "perigee-cost-model", "version": 1, "fitted_speedup": 0}, "fitted_speedup"),
    ],
)
def test_bad_documents_are_refused(doc, msg):
    with pytest.raises(ValueError, match=msg):
        FittedCostModel.from_json(doc)


def test_samples_without_prefix_variation_cannot_fit_the_prefix_terms():
    with pytest.raises(ValueError, match="determine only"):
        fit_prefill([PrefillSample(n, 0, COST.prefill_time(n)) for n in (256, 512, 1024, 2048)])
    with pytest.raises(ValueError, match="no samples"):
        fit_prefill([])


def test_poly_evaluation():
    poly = Poly2D(((0, 0, 1.0), (1, 0, 2.0), (1, 1, 3.0)))
    assert poly(2, 5) == 1 + 4 + 30
    assert Poly2D.from_json(poly.to_json()) == poly


def test_default_grid_rounds_prefixes_to_blocks_and_caps_lengths():
    assert profile.default_grid(32, 8192, (100, 9000), (0.0, 0.5)) == [
        (100, 0),
        (100, 32),
        (8191, 0),
        (8191, 4064),
    ]


# ----------------------------------------------------------------- profile collection


class ClockSleep:
    """The mock engine's sleep: time passes on a ManualClock only."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock

    async def __call__(self, seconds: float) -> None:
        await asyncio.sleep(0)
        self.clock.advance(seconds)


async def test_profile_engine_in_process_measures_the_cost_model_exactly():
    clock = ManualClock()
    spec = ModelSpec.from_dir()
    layout = KVLayout(spec, 32)
    engine = make_engine("mock", spec, COST, sleep=ClockSleep(clock))
    grid = [(n, p) for n in (64, 128, 256, 512) for p in (0, n // 4, n // 2)]
    samples = await profile.profile_engine(engine, layout, grid, now=clock.now)
    assert [(s.n, s.p) for s in samples] == grid
    for s in samples:
        assert s.seconds == pytest.approx(COST.prefill_time(s.n, s.p), rel=1e-9)
    m = fit_cost_model(samples)
    assert m.prefill_fit.coef(2, 0) == pytest.approx(analytic_prefill_terms(COST)[(2, 0)], rel=1e-6)


async def test_profile_decode_in_process_fits_the_step_time():
    clock = ManualClock()
    spec = ModelSpec.from_dir()
    layout = KVLayout(spec, 32)
    cost = CostModel(decode_seq_s=2e-4)
    engine = make_engine("mock", spec, cost, sleep=ClockSleep(clock))
    await engine.start()
    try:
        samples = await profile.profile_decode_engine(
            engine, layout, (1, 3, 6), (64, 160), steps=4, now=clock.now
        )
    finally:
        await engine.stop()
    assert [(s.batch) for s in samples] == [1, 1, 3, 3, 6, 6]
    for s in samples:
        assert s.seconds == pytest.approx(cost.decode_step_time(s.batch, s.context), rel=1e-9)
    poly, _ = fit_decode(samples)
    assert poly.coef(1, 0) == pytest.approx(2e-4, rel=1e-6)


class FakeTarget:
    """A stack whose TTFT is the analytic prefill plus 3 ms, whose prefix blocks commit
    only after its first request, and which fails one request."""

    def __init__(self, block_size: int = 32) -> None:
        self.bs = block_size
        self.cached: dict[tuple[int, ...], int] = {}
        self.warmups: dict[tuple[int, ...], int] = {}
        self.sent: list[int] = []

    async def generate(self, ids):
        self.sent.append(len(ids))
        if len(ids) == 999:
            return profile.ProfileOutcome(0.0, 0, "429 busy")
        hit = 0
        for k in range(len(ids) // self.bs, 0, -1):
            if tuple(ids[: k * self.bs]) in self.cached:
                hit = k * self.bs
                break
        key = tuple(ids)
        self.warmups[key] = self.warmups.get(key, 0) + 1
        if self.warmups[key] >= 1:
            self.cached[key] = 1
        return profile.ProfileOutcome(COST.prefill_time(len(ids), hit) + 0.003, hit)


async def test_profile_live_warms_prefixes_until_cached_and_skips_failures():
    target = FakeTarget()
    pauses = []

    async def pause(s):
        pauses.append(s)

    grid = [(256, 0), (256, 128), (512, 256), (999, 0), (1024, 512), (2048, 1024), (2048, 0)]
    samples = await profile.profile_live(target, grid, vocab=1024, pause=pause)
    assert [(s.n, s.p) for s in samples] == [
        (256, 0),
        (256, 128),
        (512, 256),
        (1024, 512),
        (2048, 1024),
        (2048, 0),
    ]
    # each prefix: sent, not yet cached; sent again, cached -> then the prompt
    assert target.sent[:1] == [256]
    assert target.sent[1:4] == [128, 128, 256]
    assert pauses == [0.02, 0.02, 0.02, 0.02]
    for s in samples:
        assert s.seconds == pytest.approx(COST.prefill_time(s.n, s.p) + 0.003, rel=1e-12)


def test_profile_cli_in_process_writes_a_loadable_model(tmp_path):
    out = tmp_path / "cm.json"
    raw = tmp_path / "samples.json"
    rc = profile.main(
        [
            "--json",
            str(out),
            "--samples-json",
            str(raw),
            "--speedup",
            "1000",
            "--lengths",
            "64,128,256",
            "--fractions",
            "0,0.25,0.5,0.75",
        ]
    )
    assert rc == 0
    m = load_cost_model(out, speedup=1000.0)
    assert isinstance(m, FittedCostModel) and m.fitted_speedup == 1000.0
    assert m.meta["source"] == "in-process mock engine"
    assert (
        len(json.loads(raw.read_text())["prefill"]) == 10
    )  # (64, 16) and (64, 48) round onto others


def test_decode_tbt_counts_a_backlog_past_max_batch():
    from services.common.cost_model import CostModel

    c = CostModel()
    assert c.decode_tbt(100, 1000, max_batch=128) == c.decode_step_time(100, 1000)
    assert c.decode_tbt(256, 2000, max_batch=128) == 2 * c.decode_step_time(128, 1000)
    assert c.decode_tbt(300, 3000, max_batch=0) == c.decode_step_time(300, 3000)


def test_tbt_joining_counts_the_request_and_everything_waiting():
    from services.common.cost_model import CostModel

    c = CostModel()
    assert c.tbt_joining(10, 3, 5000, 700) == c.decode_tbt(14, 5700)
    assert c.tbt_joining(127, 0, 1000, 24, max_batch=64) == 2 * c.decode_step_time(64, 512)
