"""The adaptive kvcache_balancing_threshold, alone and inside PlacementPolicy, on a
ManualClock with exact expectations."""

import pytest

from bus_schemas.load import DecodeLoad, PrefillLoad
from services.common.clock import ManualClock
from services.common.cost_model import CostModel
from services.conductor.balancing import AdaptiveThreshold
from services.conductor.placement_policy import (
    Placement,
    PlacementPolicy,
    PlacementRequest,
    RemoteSource,
)

BS = 32
COST = CostModel()
N = 4 * BS + 10
HASHES = (100, 101, 102, 103)


def ctl(clock, **kw) -> AdaptiveThreshold:
    kw.setdefault("interval_s", 5.0)
    kw.setdefault("min_samples", 4)
    return AdaptiveThreshold(clock, **kw)


def feed(c: AdaptiveThreshold, pulls: list[float], locals_: list[float], tag: str = "") -> list:
    """Record and observe requests with predicted TTFT 1 s and the given observed TTFTs."""
    out = []
    for i, obs in enumerate(pulls):
        c.record(f"{tag}p{i}", True, 1.0)
        out.append(c.observe(f"{tag}p{i}", obs))
    for i, obs in enumerate(locals_):
        c.record(f"{tag}l{i}", False, 1.0)
        out.append(c.observe(f"{tag}l{i}", obs))
    return out


def test_pulls_slower_than_predicted_raise_the_threshold():
    clock = ManualClock()
    c = ctl(clock)
    clock.advance(5.0)
    # pulls took twice their prediction, local placements exactly theirs: bias 2.0
    assert feed(c, [2.0, 2.0], [1.0, 1.0]) == [None, None, None, 3.0]
    assert c.threshold == 3.0
    assert c.history == [(5.0, 3.0, 2.0)]


def test_bias_is_relative_to_the_local_placements():
    clock = ManualClock()
    c = ctl(clock)
    clock.advance(5.0)
    # everything runs 2x slow (e.g. the model's speed is off): pulls are not to blame
    feed(c, [2.0, 2.0], [2.0, 2.0])
    assert c.history[-1][2] == 1.0
    assert c.threshold == 2.0 / 1.1


def test_at_most_one_step_per_interval_and_only_with_enough_samples():
    clock = ManualClock()
    c = ctl(clock)
    assert feed(c, [3.0, 3.0], [1.0, 1.0]) == [None] * 4  # interval not over yet
    assert c.threshold == 2.0
    clock.advance(5.0)
    assert feed(c, [3.0], [], tag="b") == [3.0]  # 5 samples now, bias 3.0
    clock.advance(4.0)
    assert feed(c, [3.0, 3.0], [1.0, 1.0], tag="c") == [None] * 4  # 4 s since the last step
    assert c.threshold == 3.0


def test_pulls_on_time_lower_the_threshold_to_its_floor():
    clock = ManualClock()
    c = ctl(clock, initial=1.2)
    for k in range(3):
        clock.advance(5.0)
        feed(c, [1.0, 1.0], [1.0, 1.0], tag=str(k))
    assert [round(t, 12) for _, t, _ in c.history] == [round(1.2 / 1.1, 12), 1.0, 1.0]
    assert c.threshold == 1.0


def test_no_pull_in_the_window_probes_downwards():
    clock = ManualClock()
    c = ctl(clock)
    clock.advance(5.0)
    feed(c, [], [1.0, 5.0, 1.0, 1.0])
    assert c.history == [(5.0, 2.0 / 1.1, None)]


def test_dead_band_holds_the_threshold_but_starts_a_new_window():
    clock = ManualClock()
    c = ctl(clock)
    clock.advance(5.0)
    assert feed(c, [1.2, 1.2], [1.0, 1.0]) == [None] * 4  # bias 1.2 in (1.125, 1.25]
    assert c.threshold == 2.0
    assert c.history == [(5.0, 2.0, 1.2)]
    clock.advance(1.0)
    assert feed(c, [9.0, 9.0], [1.0, 1.0], tag="x") == [None] * 4  # new window: too early


def test_upper_bound_and_prediction_floor():
    clock = ManualClock()
    c = ctl(clock, initial=12.0, hi=16.0)
    clock.advance(5.0)
    c.record("a", True, 0.0)  # predicted 0: the ratio uses min_predicted_s = 1 ms
    c.record("b", True, 0.0)
    c.record("c", False, 1.0)
    c.record("d", False, 1.0)
    for rid, obs in (("a", 0.002), ("b", 0.002), ("c", 1.0)):
        assert c.observe(rid, obs) is None
    assert c.observe("d", 1.0) == 16.0  # bias 2.0 -> 12 * 1.5 capped at 16
    assert c.observe("unknown", 1.0) is None
    c.record("e", True, 1.0)
    c.forget("e")
    assert c.observe("e", 1.0) is None


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError):
        AdaptiveThreshold(ManualClock(), initial=0.5, lo=1.0)
    with pytest.raises(ValueError):
        AdaptiveThreshold(ManualClock(), up=1.0)


# ----------------------------------------------------------------- inside the policy


def report(pol: PlacementPolicy, ts: float) -> None:
    pol.observe_prefill(
        PrefillLoad(
            instance="p0", node="n0", queue_len=0, queued_tokens=0, queued_work_s=0.0, ts=ts
        )
    )
    pol.observe_prefill(
        PrefillLoad(
            instance="p1", node="n1", queue_len=0, queued_tokens=0, queued_work_s=10.0, ts=ts
        )
    )
    pol.observe_decode(
        DecodeLoad(
            instance="d0",
            node="m0",
            batch_size=0,
            waiting=0,
            max_batch=64,
            kv_tokens=0,
            step_time_s=0.0,
            ts=ts,
        )
    )


def policy(clock, adaptive) -> PlacementPolicy:
    pol = PlacementPolicy(clock, COST, adaptive=adaptive)
    report(pol, clock.now())
    return pol


def req(rid: str) -> PlacementRequest:
    return PlacementRequest(request_id=rid, num_tokens=N, block_hashes=HASHES, block_size=BS)


def test_policy_feeds_the_controller_and_uses_its_threshold():
    clock = ManualClock(0.0)
    c = AdaptiveThreshold(clock, initial=1.6, interval_s=5.0, min_samples=2)
    pol = policy(clock, c)
    assert pol.threshold() == 1.6
    # n0 holds 2 blocks, n1 3 but p1 is busy: 3/2 = 1.5 <= 1.6 -> p0 recomputes
    a = pol.place(req("a"), {"n0": 2, "n1": 3})
    assert isinstance(a, Placement) and a.prefill_instance == "p0" and a.remote is None
    # n0 holds nothing: ratio inf -> p0 pulls all 3 blocks
    b = pol.place(req("b"), {"n1": 3})
    assert isinstance(b, Placement) and b.remote == RemoteSource("n1", 0, 3)
    assert pol.stats["pulls"] == 1 and pol.stats["pulled_blocks"] == 3
    clock.advance(5.0)
    report(pol, 5.0)  # covers both dispatches' prefill work; the controller still waits
    # both ran exactly as predicted (ts - placed_at == est_ttft_s): bias 1.0 -> down
    pol.prefill_done("a", ts=a.est_ttft_s)
    pol.prefill_done("b", ts=b.est_ttft_s)
    assert c.history == [(5.0, 1.6 / 1.1, 1.0)]
    assert pol.threshold() == 1.6 / 1.1
    # 1.5 > 1.4545...: the same situation now pulls the missing block
    again = pol.place(req("c"), {"n0": 2, "n1": 3})
    assert isinstance(again, Placement) and again.remote == RemoteSource("n1", 2, 1)


def test_released_placements_are_not_observed():
    clock = ManualClock()
    c = AdaptiveThreshold(clock, interval_s=0.0, min_samples=1)
    pol = policy(clock, c)
    pol.place(req("a"), {"n1": 3})
    pol.release("a")
    pol.prefill_done("a", ts=1.0)
    assert c.history == []
