"""The dynamic P/D ratio controller (paper §5.1) on a ManualClock, exact decisions."""

import pytest

from bus_schemas.load import DecodeLoad, PrefillLoad
from services.common.clock import ManualClock
from services.conductor.pd_ratio import PDPlan, PDRatioController, RoleChange, trimmed_mean


def feed(c: PDRatioController, role: str, loads: dict[str, list[float]]) -> None:
    for inst, xs in loads.items():
        for x in xs:
            c.observe(role, inst, x)


def test_trimmed_mean_drops_ten_percent_at_each_end():
    assert trimmed_mean([float(i) for i in range(1, 11)]) == 5.5
    assert trimmed_mean([0.0, 100.0] + [1.0] * 8) == 1.0
    assert trimmed_mean([3.0, 5.0]) == 4.0  # too few to trim
    assert trimmed_mean([]) is None


def test_needs_samples_of_both_roles():
    c = PDRatioController(ManualClock(), min_samples=3)
    feed(c, "prefill", {"p0": [0.5] * 3})
    feed(c, "decode", {"d0": [0.5] * 2})
    assert c.plan(["p0"], ["d0"]) == PDPlan(None, 0.5, None, reason="not enough samples")


def test_decode_heavy_switches_the_least_loaded_prefill_instances():
    clock = ManualClock(100.0)
    c = PDRatioController(clock, max_step=2, min_samples=10)
    # prefill mean 0.1 (one outlier each way is trimmed), decode mean 2.0
    feed(c, "prefill", {"p0": [0.1] * 4 + [9.0], "p1": [0.1] * 3 + [-5.0, 0.1], "p2": [0.1] * 2})
    feed(c, "decode", {"d0": [2.0] * 10})
    assert c.loads() == (0.1, 2.0)
    assert c.imbalance() == 3.0 / 1.1
    plan = c.plan(["p0", "p1", "p2"], ["d0"])
    # demand: prefill 0.1*3, decode 2.0*1. One move: f'(2,2) = 2/1.15; a second move
    # still helps: f'(1,3) = (2/3+1)/1.3 is closer to 1; max_step stops there.
    assert plan.prefill_delta == -2 and plan.decode_delta == 2
    # latest loads: p0 9.0, p1 0.1, p2 0.1 -> p1 and p2 go
    assert plan.switches == (
        RoleChange("p1", "prefill", "decode"),
        RoleChange("p2", "prefill", "decode"),
    )
    assert plan.f_im == 3.0 / 1.1 and plan.changed
    assert c.history == [(100.0, plan)]


def test_stops_moving_when_another_move_would_overshoot():
    c = PDRatioController(ManualClock(), max_step=5, min_samples=2)
    feed(c, "prefill", {"p0": [0.5, 0.5], "p1": [0.5, 0.5]})
    feed(c, "decode", {"d0": [3.0, 3.0], "d1": [3.0, 3.0]})
    plan = c.plan(["p0", "p1", "p2", "p3"], ["d0", "d1"])
    # f = 4/1.5. dem_p = 0.5*4 = 2, dem_d = 3*2 = 6. (3,3): 3/(5/3) = 1.8;
    # (2,4): 2.5/2 = 1.25; (1,5): 2.2/3 = 0.733 is further from 1 than 1.25 -> stop at 2.
    assert (plan.prefill_delta, plan.decode_delta) == (-2, 2)
    assert [s.instance for s in plan.switches] == ["p2", "p3"]  # never reported: load 0


def test_prefill_heavy_switches_decode_instances():
    c = PDRatioController(ManualClock(), min_samples=2)
    feed(c, "prefill", {"p0": [4.0, 4.0]})
    feed(c, "decode", {"d0": [0.2, 0.2], "d1": [0.1, 0.1]})
    plan = c.plan(["p0"], ["d0", "d1"])
    assert plan.f_im == pytest.approx(1.15 / 5.0)
    assert (plan.prefill_delta, plan.decode_delta) == (1, -1)
    assert plan.switches == (RoleChange("d1", "decode", "prefill"),)


def test_hysteresis_band_and_pool_minimum():
    c = PDRatioController(ManualClock(), min_samples=1)
    feed(c, "prefill", {"p0": [0.4]})
    feed(c, "decode", {"d0": [1.0]})
    assert c.plan(["p0", "p1"], ["d0"]).reason == "within the band"  # f = 2/1.4 < 1.5
    c2 = PDRatioController(ManualClock(), min_samples=1)
    feed(c2, "prefill", {"p0": [0.0]})
    feed(c2, "decode", {"d0": [5.0]})
    plan = c2.plan(["p0"], ["d0"])
    assert plan.reason == "at the pool minimum" and not plan.changed


def test_after_a_change_samples_restart_and_a_cooldown_holds():
    clock = ManualClock()
    c = PDRatioController(clock, min_samples=1, cooldown_s=30.0)
    feed(c, "prefill", {"p0": [0.0], "p1": [0.0]})
    feed(c, "decode", {"d0": [5.0]})
    assert c.plan(["p0", "p1"], ["d0"]).changed
    assert c.plan(["p0"], ["d0", "p1"]).reason == "not enough samples"
    feed(c, "prefill", {"p0": [0.0]})
    feed(c, "decode", {"d0": [5.0], "p1": [5.0]})
    clock.advance(29.0)
    assert c.plan(["p0"], ["d0", "p1"]).reason == "cooling down"
    clock.advance(1.0)
    assert c.plan(["p0"], ["d0", "p1"]).reason == "at the pool minimum"


def test_samples_older_than_the_window_do_not_count():
    clock = ManualClock()
    c = PDRatioController(clock, window_s=60.0, min_samples=1)
    c.observe("prefill", "p0", 9.0)
    c.observe("decode", "d0", 0.0)
    clock.advance(61.0)
    c.observe("decode", "d0", 1.0)
    assert c.loads() == (None, 1.0)
    c.observe("prefill", "p0", 1.0, ts=clock.now())
    assert c.loads() == (1.0, 1.0)


def test_scale_out_adds_to_the_heavier_side_first():
    c = PDRatioController(ManualClock(), max_step=3, min_samples=1)
    feed(c, "prefill", {"p0": [2.0]})
    feed(c, "decode", {"d0": [3.0]})
    plan = c.plan(["p0"], ["d0"], scale=5)
    # per instance now p 2, d 3: +d (-> 1.5), then +p (2 > 1.5; -> 1.0), then +d; capped at 3
    assert (plan.prefill_delta, plan.decode_delta) == (1, 2)
    assert plan.switches == () and plan.remove == ()


def test_scale_in_removes_from_the_lighter_side_least_loaded_first():
    c = PDRatioController(ManualClock(), max_step=2, min_samples=1)
    feed(c, "prefill", {"p0": [0.3], "p1": [0.1], "p2": [0.2]})
    feed(c, "decode", {"d0": [2.0], "d1": [2.0]})
    plan = c.plan(["p0", "p1", "p2"], ["d0", "d1"], scale=-3)
    # prefill per instance 0.2 vs decode 2.0: two prefill instances go (bounded by 2)
    assert (plan.prefill_delta, plan.decode_delta) == (-2, 0)
    assert plan.remove == ("p1", "p2")
    c2 = PDRatioController(ManualClock(), min_samples=1)
    feed(c2, "prefill", {"p0": [0.0]})
    feed(c2, "decode", {"d0": [0.0]})
    assert c2.plan(["p0"], ["d0"], scale=-1).reason == "at the pool minimum"


def test_load_reports_in_slo_units():
    c = PDRatioController(ManualClock(), min_samples=1)
    c.observe_prefill(
        PrefillLoad(
            instance="p0", node="n", queue_len=1, queued_tokens=1, queued_work_s=3.0, ts=0.0
        ),
        30.0,
    )
    c.observe_decode(
        DecodeLoad(
            instance="d0",
            node="m",
            batch_size=1,
            waiting=0,
            max_batch=8,
            kv_tokens=1,
            step_time_s=0.05,
            ts=0.0,
        ),
        0.1,
    )
    assert c.loads() == (0.1, 0.5)
    with pytest.raises(ValueError):
        c.observe("router", "x", 1.0)
    with pytest.raises(ValueError):
        PDRatioController(ManualClock(), low=1.2)
