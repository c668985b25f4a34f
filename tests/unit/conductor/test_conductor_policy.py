"""Algorithm 1 with a hand-moved clock: exact choices and exact cost-model estimates."""

import random

import pytest

from bus_schemas.load import DecodeLoad, PrefillLoad
from bus_schemas.requests import ErrorCode, GenerateRequest
from services.common.clock import ManualClock
from services.common.cost_model import CostModel
from services.common.hashing import block_hashes
from services.conductor.placement_policy import (
    Placement,
    PlacementPolicy,
    PlacementRequest,
    Rejection,
    RemoteSource,
    TtftFeedback,
)

BS = 32
COST = CostModel()
N = 4 * BS + 10  # 4 full blocks and a tail
HASHES = tuple(range(100, 104))


def req(rid: str = "r1", n: int = N, **kw) -> PlacementRequest:
    return PlacementRequest(request_id=rid, num_tokens=n, block_hashes=HASHES, block_size=BS, **kw)


def pload(instance: str, node: str, work: float = 0.0, ts: float = 0.0) -> PrefillLoad:
    return PrefillLoad(
        instance=instance, node=node, queue_len=0, queued_tokens=0, queued_work_s=work, ts=ts
    )


def dload(
    instance: str, node: str, batch: int = 0, kv: int = 0, waiting: int = 0, ts: float = 0.0
) -> DecodeLoad:
    return DecodeLoad(
        instance=instance,
        node=node,
        batch_size=batch,
        waiting=waiting,
        max_batch=64,
        kv_tokens=kv,
        step_time_s=0.0,
        ts=ts,
    )


def make_policy(
    clock=None, prefills=(("p0", "n0", 0.0), ("p1", "n1", 0.0)), decodes=(("d0", "m0"),), **kw
):
    clock = clock or ManualClock(0.0)
    pol = PlacementPolicy(clock, COST, **kw)
    for inst, node, work in prefills:
        pol.observe_prefill(pload(inst, node, work))
    for inst, node in decodes:
        pol.observe_decode(dload(inst, node))
    return pol


def placed(d) -> Placement:
    assert isinstance(d, Placement), d
    return d


def test_cache_aware_choice_prefers_the_node_holding_the_prefix():
    pol = make_policy()
    d = placed(pol.place(req(), {"n1": 3}))
    assert (d.prefill_instance, d.prefill_node) == ("p1", "n1")
    assert (d.decode_instance, d.decode_node) == ("d0", "m0")
    assert d.prefix_blocks == 3 and d.prefix_tokens == 96
    assert d.remote is None
    assert d.est_queue_s == 0.0 and d.est_transfer_s == 0.0
    assert d.est_prefill_s == COST.prefill_time(N, 96)
    assert d.est_ttft_s == COST.prefill_time(N, 96)
    assert d.est_tbt_s == COST.decode_step_time(1, N)
    assert d.strategy == "global"


def test_long_queue_beats_cache_and_pulls_the_prefix():
    pol = make_policy(prefills=(("p0", "n0", 0.0), ("p1", "n1", 10.0)))
    d = placed(pol.place(req(), {"n1": 3}))
    assert d.prefill_instance == "p0"
    # Own prefix 0: ratio inf > 2.0, so p0 counts with the remote prefix and its transfer.
    assert d.remote == RemoteSource(node="n1", first_block=0, num_blocks=3)
    assert d.prefix_blocks == 3
    assert d.est_transfer_s == COST.transfer_time(96)
    assert d.est_ttft_s == COST.transfer_time(96) + COST.prefill_time(N, 96)


def test_threshold_decides_between_pulling_and_computing():
    # p0's node holds 1 block, p1's holds 3, p1 is busy: 3/1 > 2 -> pull blocks 1..2.
    pol = make_policy(prefills=(("p0", "n0", 0.0), ("p1", "n1", 10.0)))
    d = placed(pol.place(req(), {"n0": 1, "n1": 3}))
    assert d.prefill_instance == "p0"
    assert d.remote == RemoteSource(node="n1", first_block=1, num_blocks=2)
    assert d.est_transfer_s == COST.transfer_time(64)
    assert d.est_ttft_s == COST.transfer_time(64) + COST.prefill_time(N, 96)
    # p0's node holds 2: 3/2 = 1.5 is under the threshold -> compute from its own prefix.
    pol = make_policy(prefills=(("p0", "n0", 0.0), ("p1", "n1", 10.0)))
    d = placed(pol.place(req(), {"n0": 2, "n1": 3}))
    assert d.prefill_instance == "p0" and d.remote is None
    assert d.prefix_tokens == 64
    assert d.est_ttft_s == COST.prefill_time(N, 64)
    # A lower threshold makes the same case pull.
    pol = make_policy(prefills=(("p0", "n0", 0.0), ("p1", "n1", 10.0)), balancing_threshold=1.2)
    d = placed(pol.place(req(), {"n0": 2, "n1": 3}))
    assert d.remote == RemoteSource(node="n1", first_block=2, num_blocks=1)


def test_transfer_estimate_includes_bytes_already_in_flight_from_the_source():
    pol = make_policy(prefills=(("p0", "n0", 0.0), ("p2", "n2", 0.0), ("p1", "n1", 100.0)))
    a = placed(pol.place(req("a"), {"n1": 3}))
    assert a.prefill_instance == "p0" and a.remote.node == "n1"
    assert pol.inflight_bytes("n1") == COST.kv_bytes(96)
    b = placed(pol.place(req("b"), {"n1": 3}))
    assert b.prefill_instance == "p2"  # p0 now has a's work queued
    assert b.est_transfer_s == COST.transfer_time(96, COST.kv_bytes(96))
    pol.prefill_done("a", ts=0.0)
    assert pol.inflight_bytes("n1") == COST.kv_bytes(96)  # b's pull only


def test_rejects_when_ttft_slo_cannot_be_met():
    pol = make_policy(prefills=(("p0", "n0", 40.0),), ttft_slo_s=30.0)
    d = pol.place(req(), {})
    assert isinstance(d, Rejection)
    assert d.code == ErrorCode.REJECTED
    # Back when the 40 s queued has shrunk to half the room the 30 s SLO leaves it.
    work = COST.prefill_time(N, 0)
    assert d.retry_after_s == pytest.approx(40.0 - (30.0 - work) / 2)
    assert "TTFT" in d.reason
    assert pol.dispatched() == []
    # The request's own SLO overrides the default.
    assert isinstance(pol.place(req(ttft_slo_s=60.0), {}), Placement)


def test_a_burst_turned_away_is_told_to_come_back_one_after_another():
    """Each rejection books its prefill work: the next is told to come back after it,
    so a burst does not return at once into the same backlog."""
    pol = make_policy(prefills=(("p0", "n0", 40.0),), ttft_slo_s=30.0)
    work = COST.prefill_time(N, 0)
    first = pol.place(req("a"), {})
    second = pol.place(req("b"), {})
    assert isinstance(first, Rejection) and isinstance(second, Rejection)
    assert first.retry_after_s == pytest.approx(40.0 - (30.0 - work) / 2)
    assert second.retry_after_s == pytest.approx(first.retry_after_s + work)


def test_a_promised_retry_keeps_its_room_from_a_newcomer():
    """With reserve (the live conductor), a request turned away is promised room: one
    arriving before it comes back sees that work ahead and is turned away too; the
    promised one, back as itself, does not count its own promise."""
    from services.policy.retry_schedule import RetrySchedule

    clock = ManualClock(0.0)
    work = COST.prefill_time(N, 0)
    # 40 s queued against a 30 s SLO + the request's own work: a has to come back.
    pol = make_policy(clock, prefills=(("p0", "n0", 40.0),), ttft_slo_s=30.0)
    pol.retries = RetrySchedule(
        reserve=True, grace_s=5.0, pass_share=0.0, hold_from=1
    )  # none passes
    a = pol.place(req("a"), {})
    assert isinstance(a, Rejection)
    due = a.retry_after_s
    assert due == pytest.approx(40.0 - (30.0 - work) / 2)
    # At its time, with its load report: 30 s less 1.5 works queued, room for one.
    clock.advance(due)
    pol.observe_prefill(pload("p0", "n0", 30.0 - 1.5 * work, ts=clock.now()))
    pol.observe_decode(dload("d0", "m0", ts=clock.now()))
    b = pol.place(req("b", n=N + 1), {})  # a newcomer (another prompt), first
    assert isinstance(b, Rejection) and "promised to retries" in b.reason
    again = pol.place(req("a"), {})  # a, back as itself: its own promise not ahead of it
    assert isinstance(again, Placement)


def test_a_short_request_passes_the_promised_retries():
    """A request whose own work is short (a conversation's next turn, its prompt mostly
    cached) is not held behind promised retries; the same prompt uncached is."""
    from services.policy.retry_schedule import RetrySchedule

    clock = ManualClock(0.0)
    work = COST.prefill_time(N, 0)
    full, cached = COST.prefill_time(N + 1, 0), COST.prefill_time(N + 1, len(HASHES) * BS)
    pol = make_policy(clock, prefills=(("p0", "n0", 40.0),), ttft_slo_s=30.0)
    # Between the two: the cached one passes, the uncached one does not.
    pol.retries = RetrySchedule(
        reserve=True, grace_s=5.0, pass_share=(full + cached) / 60.0, hold_from=1
    )
    a = pol.place(req("a"), {})
    assert isinstance(a, Rejection)
    clock.advance(a.retry_after_s)
    # Room for the cached request, not for it and the promised retry's work too.
    pol.observe_prefill(pload("p0", "n0", 30.0 - cached - 0.5 * work, ts=clock.now()))
    pol.observe_decode(dload("d0", "m0", ts=clock.now()))
    held = pol.place(req("b", n=N + 1), {})
    assert isinstance(held, Rejection) and "promised to retries" in held.reason
    short = pol.place(req("s", n=N + 1), {"n0": len(HASHES)})
    assert isinstance(short, Placement)


def test_unmeetable_slo_retry_after_is_at_least_one_second():
    pol = make_policy(ttft_slo_s=0.001)
    d = pol.place(req(), {})
    assert isinstance(d, Rejection) and d.code == ErrorCode.REJECTED
    assert d.retry_after_s == 1.0


def test_rejects_when_tbt_slo_cannot_be_met():
    # The weights alone take decode_step_time(1, 0) per step (~8.6 ms at A800 speed).
    slo = COST.decode_step_time(1, 0) * 0.9
    pol = make_policy(tbt_slo_s=slo)
    d = pol.place(req(), {})
    assert isinstance(d, Rejection) and d.code == ErrorCode.REJECTED and "TBT" in d.reason
    assert d.retry_after_s == 1.0
    assert isinstance(pol.place(req(tbt_slo_s=1.0), {}), Placement)


def test_without_the_tbt_check_placement_leaves_rejection_to_decode():
    # The paper's baseline: the TBT SLO is checked by the decode instance after prefill.
    slo = COST.decode_step_time(1, 0) * 0.9
    pol = make_policy(tbt_slo_s=slo, tbt_check=False)
    d = placed(pol.place(req(), {}))
    assert d.est_tbt_s == COST.decode_step_time(1, N) and d.est_tbt_s > slo
    assert pol.stats["rejected_tbt"] == 0 and pol.stats["placed"] == 1


def test_no_instance_is_503():
    pol = PlacementPolicy(ManualClock(), COST)
    d = pol.place(req(), {})
    assert d == Rejection(ErrorCode.UNAVAILABLE, "no live prefill instance", 1.0)
    pol.observe_prefill(pload("p0", "n0"))
    d = pol.place(req(), {})
    assert d == Rejection(ErrorCode.UNAVAILABLE, "no live decode instance", 1.0)


def test_dead_instances_are_excluded():
    clock = ManualClock(0.0)
    pol = make_policy(clock, decodes=(("d0", "m0"), ("d1", "m1")), dead_after_s=2.0)
    clock.set(1.5)
    pol.observe_prefill(pload("p0", "n0", ts=1.5))
    pol.observe_decode(dload("d1", "m1", ts=1.5))
    clock.set(3.0)  # p1 and d0 last seen at 0.0: dead
    assert pol.live_prefill() == ["p0"] and pol.live_decode() == ["d1"]
    d = placed(pol.place(req(), {"n1": 4}))
    assert (d.prefill_instance, d.decode_instance) == ("p0", "d1")
    clock.set(4.0)
    assert pol.place(req("r2"), {}).code == ErrorCode.UNAVAILABLE


def test_decode_choice_lowest_predicted_tbt_and_dispatches_spread():
    pol = make_policy(decodes=())
    pol.observe_decode(dload("d0", "m0", batch=2, kv=1000))
    pol.observe_decode(dload("d1", "m1", batch=1, kv=1100, waiting=1))
    # A decode step reads the weights once plus every token of context: less context wins.
    a = placed(pol.place(req("a"), {}))
    assert a.decode_instance == "d0"
    assert a.est_tbt_s == COST.decode_step_time(3, 1000 + N)
    # d0 now carries a: 1000 + N + N tokens of context against d1's 1100 + N.
    b = placed(pol.place(req("b"), {}))
    assert b.decode_instance == "d1"
    assert b.est_tbt_s == COST.decode_step_time(3, 1100 + N)


def test_dispatched_work_is_counted_until_a_newer_report():
    clock = ManualClock(10.0)
    pol = make_policy(clock)
    a = placed(pol.place(req("a"), {}))
    assert a.prefill_instance == "p0"  # tie broken by name
    assert pol.queue_s("p0") == COST.prefill_time(N, 0)
    b = placed(pol.place(req("b"), {}))
    assert b.prefill_instance == "p1"  # a's work is on p0
    # A report generated before the dispatch does not cover it.
    pol.observe_prefill(pload("p0", "n0", work=0.0, ts=9.0))
    assert pol.queue_s("p0") == COST.prefill_time(N, 0)
    # One at or after it does: the worker now reports that work itself.
    pol.observe_prefill(pload("p0", "n0", work=0.25, ts=10.0))
    assert pol.queue_s("p0") == 0.25
    assert pol.queue_s("p1") == COST.prefill_time(N, 0)
    pol.prefill_done("b", ts=11.0)
    assert pol.queue_s("p1") == 0.0


def test_decode_share_lasts_until_a_report_after_the_first_token():
    clock = ManualClock(10.0)
    pol = make_policy(clock)
    placed(pol.place(req("a"), {}))
    pol.observe_prefill(pload("p0", "n0", ts=10.5))
    assert pol.dispatched() == ["a"]  # still expected on d0
    assert pol.predicted_tbt("d0", 0) == COST.decode_step_time(2, N)
    pol.observe_decode(dload("d0", "m0", ts=11.0))
    assert pol.dispatched() == ["a"]  # first token not out yet
    pol.prefill_done("a", ts=12.0)
    pol.observe_decode(dload("d0", "m0", ts=11.5))
    assert pol.dispatched() == ["a"]
    pol.observe_decode(dload("d0", "m0", batch=1, kv=N + 1, ts=12.0))
    assert pol.dispatched() == []
    assert pol.predicted_tbt("d0", 0) == COST.decode_step_time(2, N + 1)


def test_release_and_retry_do_not_double_count():
    pol = make_policy()
    placed(pol.place(req("a"), {}))
    d = placed(pol.place(req("a"), {}, exclude_prefill={"p0"}))  # retry elsewhere
    assert d.prefill_instance == "p1"
    assert pol.queue_s("p0") == 0.0
    assert pol.queue_s("p1") == COST.prefill_time(N, 0)
    pol.release("a")
    assert pol.queue_s("p1") == 0.0 and pol.dispatched() == []


def test_excluded_source_is_not_pulled_from():
    pol = make_policy(prefills=(("p0", "n0", 0.0), ("p1", "n1", 10.0)))
    d = placed(pol.place(req(), {"n1": 3, "n2": 2}, exclude_sources={"n1"}))
    assert d.remote == RemoteSource(node="n2", first_block=0, num_blocks=2)


def test_full_prompt_hit_still_computes_the_last_token():
    r = PlacementRequest(request_id="r", num_tokens=4 * BS, block_hashes=HASHES, block_size=BS)
    pol = make_policy()
    d = placed(pol.place(r, {"n0": 4}))
    assert d.prefix_tokens == 4 * BS
    assert d.est_prefill_s == COST.prefill_time(4 * BS, 4 * BS - 1)


def test_local_strategy_never_transfers():
    pol = make_policy(prefills=(("p0", "n0", 0.0), ("p1", "n1", 10.0)), strategy="local")
    d = placed(pol.place(req(), {"n1": 3}))
    assert d.prefill_instance == "p0" and d.remote is None and d.prefix_tokens == 0
    assert d.est_ttft_s == COST.prefill_time(N, 0)
    d = placed(make_policy(strategy="local").place(req(), {"n1": 3}))
    assert d.prefill_instance == "p1" and d.prefix_tokens == 96


def test_load_strategy_ignores_the_cache():
    pol = make_policy(prefills=(("p0", "n0", 0.5), ("p1", "n1", 0.1)), strategy="load")
    d = placed(pol.place(req(), {"n0": 4}))
    assert d.prefill_instance == "p1" and d.prefix_tokens == 0 and d.remote is None
    assert d.est_ttft_s == 0.1 + COST.prefill_time(N, 0)


def test_random_strategy_uses_the_injected_rng():
    pol = make_policy(
        prefills=(("p0", "n0", 0.0), ("p1", "n1", 0.0), ("p2", "n2", 0.0)),
        strategy="random",
        rng=random.Random(7),
    )
    expected = random.Random(7)
    for i in range(5):
        d = placed(pol.place(req(f"r{i}"), {}))
        assert d.prefill_instance == expected.choice(["p0", "p1", "p2"])


def test_unknown_strategy_is_refused():
    with pytest.raises(ValueError, match="strategy"):
        PlacementPolicy(ManualClock(), COST, strategy="fastest")


def test_request_adapter_recomputes_hashes_for_another_block_size():
    tokens = list(range(100))
    g = GenerateRequest(
        request_id="g", prompt_token_ids=tokens, block_size=16, block_hashes=[1, 2, 3]
    )
    p = PlacementRequest.from_request(g, BS)
    assert p.block_hashes == tuple(block_hashes(tokens, BS))
    assert p.num_tokens == 100 and p.block_size == BS
    g = GenerateRequest(
        request_id="g",
        prompt_token_ids=tokens,
        block_size=BS,
        block_hashes=[1, 2, 3],
        ttft_slo_s=5.0,
    )
    p = PlacementRequest.from_request(g, BS)
    assert p.block_hashes == (1, 2, 3) and p.ttft_slo_s == 5.0


def test_report_grace_keeps_work_a_report_may_not_have_seen():
    clock = ManualClock(10.0)
    pol = make_policy(clock, report_grace_s=0.05)
    placed(pol.place(req("a"), {}))
    pol.observe_prefill(pload("p0", "n0", work=0.0, ts=10.04))  # task possibly still on the wire
    assert pol.queue_s("p0") == COST.prefill_time(N, 0)
    pol.observe_prefill(pload("p0", "n0", work=0.3, ts=10.05))
    assert pol.queue_s("p0") == 0.3


def test_decode_share_lasts_until_a_report_after_the_handoff():
    # The first token left prefill at 12.0, the KV reached decode at 12.4: a decode
    # report from 12.2 cannot include the request yet.
    clock = ManualClock(10.0)
    pol = make_policy(clock)
    placed(pol.place(req("a"), {}))
    pol.prefill_done("a", ts=12.0, handoff_ts=12.4)
    pol.observe_decode(dload("d0", "m0", ts=12.2))
    assert pol.dispatched() == ["a"]
    pol.observe_decode(dload("d0", "m0", batch=1, kv=N + 1, ts=12.4))
    assert pol.dispatched() == []


def test_ttft_feedback_averages_observed_over_predicted_per_instance():
    fb = TtftFeedback(alpha_up=0.5, alpha_down=0.25, lo=0.5, hi=8.0, min_predicted_s=0.02)
    assert fb.factor("p0") == 1.0
    fb.observe("p0", 1.0, 3.0)  # first observation: taken as is
    assert fb.factor("p0") == 3.0
    fb.observe("p0", 2.0, 2.0)  # ratio 1: a quarter of the way back (down is slow)
    assert fb.factor("p0") == 2.5
    fb.observe("p0", 0.01, 5.0)  # below min_predicted_s: ignored
    fb.observe("p0", 1.0, 100.0)  # clipped to hi, half of the way up (up is fast)
    assert fb.factor("p0") == 5.25
    assert fb.factor("p1") == 1.0


def test_ttft_feedback_makes_a_slow_instance_reject_what_its_fit_would_accept():
    clock = ManualClock(100.0)
    fb = TtftFeedback(alpha_up=1.0)
    pol = make_policy(clock, prefills=(("p0", "n0", 4.0),), feedback=fb, ttft_slo_s=10.0)
    first = placed(pol.place(req("a"), {}))
    predicted = first.est_ttft_s
    assert 4.0 < predicted < 10.0  # the fitted costs alone accept it
    clock.advance(3 * predicted)  # ...but its first token came three times later
    pol.prefill_done("a", clock.now())
    assert fb.factor("p0") == pytest.approx(3.0)
    pol.observe_prefill(pload("p0", "n0", 4.0, ts=clock.now()))
    pol.observe_decode(dload("d0", "m0", ts=clock.now()))
    d = pol.place(req("b"), {})
    assert isinstance(d, Rejection) and d.code == ErrorCode.REJECTED
    assert "exceeds the 10s SLO" in d.reason
    # without feedback the same state is accepted
    plain = make_policy(ManualClock(0.0), prefills=(("p0", "n0", 4.0),), ttft_slo_s=10.0)
    assert isinstance(plain.place(req("b"), {}), Placement)


def test_time_spent_before_placement_counts_against_the_ttft_slo():
    clock = ManualClock(100.0)
    pol = make_policy(clock, prefills=(("p0", "n0", 3.0),), ttft_slo_s=5.0)
    fresh = placed(pol.place(req("a", arrival_ts=99.5), {}))
    assert 3.0 < fresh.est_ttft_s < 4.5  # 0.5 s waited + the estimate: within 5 s
    pol.release("a")
    late = pol.place(req("b", arrival_ts=98.0), {})  # 2 s in the gateway and on the bus
    assert isinstance(late, Rejection) and late.code == ErrorCode.REJECTED
    assert "after 2.000s before placement" in late.reason
    # Back when the 3 s queued leaves half the room (5 s less 2 s waited less its work).
    work = fresh.est_ttft_s - 3.0
    assert late.retry_after_s == pytest.approx(max(1.0, 3.0 - (5.0 - 2.0 - work) / 2))
    pol.release("b")
    assert isinstance(pol.place(req("c", arrival_ts=0.0), {}), Placement)  # unknown: not counted
    pol.release("c")
    assert isinstance(pol.place(req("d", arrival_ts=200.0), {}), Placement)  # clock skew: clamped


def test_ttft_margin_plans_placements_below_the_slo():
    clock = ManualClock(0.0)
    full = make_policy(clock, prefills=(("p0", "n0", 4.6),), ttft_slo_s=5.0)
    est = placed(full.place(req("a"), {})).est_ttft_s
    assert 4.5 < est < 5.0
    tight = make_policy(
        ManualClock(0.0), prefills=(("p0", "n0", 4.6),), ttft_slo_s=5.0, ttft_margin=0.9
    )
    d = tight.place(req("a"), {})
    assert isinstance(d, Rejection) and "(planned to 90%)" in d.reason


def test_an_idle_instance_serves_a_request_its_model_predicts_over_the_slo():
    """serve_when_idle (the live conductor): nothing queues ahead, so no later placement
    is faster; the request is placed (and its prefill corrects a model too slow)."""
    slo = COST.prefill_time(N) / 2  # the request alone misses it
    strict = make_policy(prefills=(("p0", "n0", 0.0),), ttft_slo_s=slo)
    assert isinstance(strict.place(req("a"), {}), Rejection)  # the paper's Algorithm 1
    pol = make_policy(prefills=(("p0", "n0", 0.0),), ttft_slo_s=slo, serve_when_idle=True)
    assert placed(pol.place(req("a"), {})).est_ttft_s > slo
    # p0 now has a's work queued: b would wait behind it, and is turned away.
    b = pol.place(req("b"), {})
    assert isinstance(b, Rejection) and b.code == ErrorCode.REJECTED


def test_an_idle_decode_instance_serves_a_request_predicted_over_the_tbt_slo():
    slo = COST.decode_step_time(1, N) / 2
    pol = make_policy(
        prefills=(("p0", "n0", 0.0), ("p1", "n1", 0.0)), tbt_slo_s=slo, serve_when_idle=True
    )
    assert placed(pol.place(req("a"), {})).decode_instance == "d0"
    b = pol.place(req("b"), {})  # d0 holds a now (placed, not yet in its reports)
    assert isinstance(b, Rejection) and "predicted TBT" in b.reason
