"""Chunked pipeline parallelism: the pure pipeline timing and Algorithm 1's choice
between one instance and a group, with exact expectations on a ManualClock.

A linear cost model keeps the arithmetic exact: prefill_time(b, a) = b - a seconds
(one layer, a = 0, b = 1, d = 1, 1 flop/s), activations 1 byte per token over a
4 byte/s link, so a 4-token chunk's hand-off takes 1 s."""

import pytest

from bus_schemas.load import DecodeLoad, PrefillLoad
from services.common.clock import ManualClock
from services.common.cost_model import CostModel
from services.conductor.placement_policy import (
    Placement,
    PlacementPolicy,
    PlacementRequest,
    Rejection,
)
from services.policy import chunk_timing

LIN = CostModel(layers=1, d=1, a=0.0, b=1.0, gqa=1, elem_bytes=1, gpu_flops=1.0, nic_bw=4.0)
BS = 4


def test_chunk_bounds_cut_the_uncached_suffix_and_always_compute_the_last_token():
    assert chunk_timing.chunk_bounds(10, 3, 4) == [(3, 7), (7, 10)]
    assert chunk_timing.chunk_bounds(10, 0, 10) == [(0, 10)]
    assert chunk_timing.chunk_bounds(10, 10, 4) == [(9, 10)]
    with pytest.raises(ValueError):
        chunk_timing.chunk_bounds(10, 0, 0)


def test_two_stage_pipeline_timing_fill_then_steady_state():
    # chunk 0: stage 0 [0, 2], hand-off 1 s, stage 1 [3, 5]
    # chunk 1: stage 0 [2, 4], hand-off to 5, stage 1 [5, 7]
    t = chunk_timing.pipeline_timing([LIN, LIN], 8, 0, 4)
    assert t.chunks == ((0, 4), (4, 8))
    assert t.stage_start_s == (0.0, 3.0)
    assert t.stage_end_s == (4.0, 7.0)
    assert t.stage_compute_s == (4.0, 4.0)
    assert t.handoff_s == (1.0, 1.0)
    assert t.ttft_s == 7.0 and t.stages == 2


def test_a_slow_stage_sets_the_pace_and_hand_offs_wait_for_it():
    slow = CostModel(layers=1, d=1, a=0.0, b=2.0, gqa=1, elem_bytes=1, gpu_flops=1.0, nic_bw=4.0)
    # stage 1 takes 4 s per 4-token chunk: chunk 1 waits for it, not for its input
    t = chunk_timing.pipeline_timing([LIN, slow], 8, 0, 4, link=LIN)
    assert t.stage_end_s == (4.0, 11.0)  # stage 1: [3, 7], then [7, 11]


def test_one_stage_is_the_chunked_prefill_of_one_instance():
    from services.prefill.queue import chunked_prefill_time

    cost = CostModel()
    for n, prefix in ((100_000, 0), (70_000, 20_000), (3000, 0)):
        t = chunk_timing.pipeline_timing([cost], n, prefix, 4096)
        assert t.ttft_s == chunked_prefill_time(cost, n, prefix, 4096)


def test_four_stages_cut_a_long_prompt_below_forty_percent_on_the_paper_model():
    cost = CostModel()
    n = 65_536
    one = cost.prefill_time(n)
    four = chunk_timing.pipeline_timing([cost] * 4, n, 0, chunk_timing.DEFAULT_CHUNK_TOKENS).ttft_s
    assert four < 0.4 * one
    # one chunk: the group only adds hand-offs
    short = chunk_timing.pipeline_timing([cost] * 4, 2000, 0, chunk_timing.DEFAULT_CHUNK_TOKENS)
    assert short.ttft_s == pytest.approx(cost.prefill_time(2000) + 3 * short.handoff_s[0])
    assert short.ttft_s > cost.prefill_time(2000)


def test_groups_are_every_x_instances_in_name_order():
    assert chunk_timing.form_groups(["p3", "p1", "p4", "p0", "p2"], 2) == [
        ("p0", "p1"),
        ("p2", "p3"),
    ]
    assert chunk_timing.form_groups(["p0", "p1"], 4) == []
    assert chunk_timing.form_groups(["p0", "p1"], 1) == []
    node_of = {"p0": "n0", "p1": "n1", "p2": "n2"}
    assert chunk_timing.anchor_of(("p0", "p1", "p2"), node_of, {"n2": 3, "n1": 1}) == "p2"
    assert chunk_timing.anchor_of(("p0", "p1", "p2"), node_of, {}) == "p0"
    queues = {"p0": 2.0, "p1": 0.0, "p2": 0.0}
    assert chunk_timing.order_stages(("p0", "p1", "p2"), queues) == ("p1", "p2", "p0")
    assert chunk_timing.order_stages(("p0", "p1", "p2"), queues, anchor="p2") == ("p2", "p1", "p0")
    with pytest.raises(ValueError):
        chunk_timing.CppConfig(group_size=0)


def test_ready_times_and_member_work():
    assert chunk_timing.ready_times([1.0, 3.0, 0.0], 2.0, anchor=0) == [1.0, 3.0, 2.0]
    assert chunk_timing.ready_times([1.0, 3.0, 0.0], 2.0, anchor=2) == [2.0, 3.0, 0.0]
    # stage 0 from 1 s: [1, 3], [3, 5]; stage 1 from 4 s (its queue), input at 4 s:
    # [4, 6], then chunk 1's input at 6: [6, 8]
    t = chunk_timing.pipeline_timing([LIN, LIN], 8, 0, 4, ready=[1.0, 4.0])
    assert t.stage_start_s == (1.0, 4.0) and t.stage_end_s == (5.0, 8.0)
    assert chunk_timing.member_work([1.0, 4.0], t) == [4.0, 4.0]
    # the first stages of a longer pipeline compute their 1/parts of the layers
    assert chunk_timing.pipeline_timing([LIN], 8, 0, 4, parts=2).stage_end_s == (4.0,)


# ---------------------------------------------------------------- Algorithm 1


def pload(instance, node, work=0.0, ts=0.0):
    return PrefillLoad(
        instance=instance, node=node, queue_len=0, queued_tokens=0, queued_work_s=work, ts=ts
    )


def make_policy(works=(0.0, 0.0), group=2, chunk=4, cost=LIN, min_tokens=1, interleave=4, **kw):
    clock = ManualClock(0.0)
    pol = PlacementPolicy(
        clock,
        cost,
        ttft_slo_s=1000.0,
        tbt_slo_s=10.0,
        cpp=chunk_timing.CppConfig(
            group_size=group,
            chunk_tokens=chunk,
            min_tokens=min_tokens,
            interleave_tokens=interleave,
        ),
        **kw,
    )
    for i, w in enumerate(works):
        pol.observe_prefill(pload(f"p{i}", f"n{i}", w))
    pol.observe_decode(
        DecodeLoad(
            instance="d0",
            node="m0",
            batch_size=0,
            waiting=0,
            max_batch=8,
            kv_tokens=0,
            step_time_s=0.0,
            ts=0.0,
        )
    )
    return pol, clock


def req(n, rid="r1", hashes=None):
    hashes = tuple(range(100, 100 + n // BS)) if hashes is None else hashes
    return PlacementRequest(request_id=rid, num_tokens=n, block_hashes=hashes, block_size=BS)


def placed(d) -> Placement:
    assert isinstance(d, Placement), d
    return d


def test_a_long_request_goes_to_the_group_with_the_pipeline_estimate():
    pol, _ = make_policy()
    d = placed(pol.place(req(8), {}))
    assert d.cpp_stages == ("p0", "p1") and d.cpp_stage_nodes == ("n0", "n1")
    assert (d.prefill_instance, d.prefill_node) == ("p0", "n0")
    assert d.cpp_chunk_tokens == 4 and d.cpp_stage_end_s == (4.0, 7.0)
    assert d.est_prefill_s == 7.0 and d.est_ttft_s == 7.0  # one instance: 8.0
    assert d.est_queue_s == 0.0 and d.est_transfer_s == 0.0
    # each member carries its own stage until a report covers it
    assert pol.queue_s("p0") == 4.0 and pol.queue_s("p1") == 7.0


def test_a_one_chunk_request_stays_on_one_instance():
    pol, _ = make_policy()
    d = placed(pol.place(req(4), {}))
    assert d.cpp_stages == () and d.cpp_chunk_tokens == 0
    assert d.est_prefill_s == 4.0
    assert pol.queue_s("p0") + pol.queue_s("p1") == 4.0


def test_a_tie_keeps_the_request_single():
    free_link = CostModel(
        layers=1, d=1, a=0.0, b=1.0, gqa=1, elem_bytes=1, gpu_flops=1.0, nic_bw=float("inf")
    )
    pol, _ = make_policy(cost=free_link)
    d = placed(pol.place(req(4), {}))  # group: 2 + 2 s with a free hand-off, single: 4 s
    assert d.cpp_stages == () and d.est_ttft_s == 4.0


def test_a_busy_downstream_member_delays_only_the_chunks_behind_it():
    # p1 busy for 5 s: stage 1 runs [5, 7] and [7, 9]; 9 s loses to p0 alone (8 s)
    pol, _ = make_policy(works=(0.0, 5.0))
    d = placed(pol.place(req(8), {}))
    assert d.cpp_stages == () and d.prefill_instance == "p0" and d.est_ttft_s == 8.0
    # p1 busy for 0.5 s: hidden by the fill (chunk 0 reaches it at 3 s): 7 s
    pol, _ = make_policy(works=(0.0, 0.5))
    d = placed(pol.place(req(8), {}))
    assert d.cpp_stages == ("p0", "p1") and d.est_queue_s == 0.0 and d.est_ttft_s == 7.0
    assert d.cpp_stage_end_s == (4.0, 7.0)
    # each member is held until its stage is done, its wait for input included
    assert pol.queue_s("p0") == 4.0 and pol.queue_s("p1") == 7.0
    # the busier member goes last: p0 busy 1 s is stage 1, hidden by the fill (7 s);
    # p0 stays the anchor (no prefix anywhere: by name)
    pol, _ = make_policy(works=(1.0, 0.0))
    d = placed(pol.place(req(8), {}))
    assert d.cpp_stages == ("p1", "p0") and d.est_ttft_s == 7.0
    assert d.prefill_instance == "p0" and d.cpp_stage_end_s == (4.0, 7.0)


def test_few_computed_tokens_are_never_offered_to_a_group():
    pol, _ = make_policy(min_tokens=9)
    assert placed(pol.place(req(8), {})).cpp_stages == ()
    pol, _ = make_policy(min_tokens=8)
    assert placed(pol.place(req(8), {})).cpp_stages == ("p0", "p1")
    # what counts is the uncached suffix: 4 of 12 tokens cached leaves 8 to compute
    pol, _ = make_policy(min_tokens=9)
    assert placed(pol.place(req(12), {"n1": 1})).cpp_stages == ()


def test_the_groups_prefix_is_its_anchors_cache_and_slices_cross_the_anchors_link():
    pol, _ = make_policy(works=(0.0, 0.0, 0.0, 0.0), group=4, chunk=8)
    # 64 tokens, n3 holds 4 blocks (16 tokens): p3 anchors the group; the three other
    # stages read 3/4 of 16 tokens' KV (2 bytes a token) over its 4 byte/s link: ready
    # at 6 s. 48 tokens in 6 chunks of 8 (2 s a stage, 2 s hand-offs): stage 0 ends
    # chunks at 2, 4, .. 12; stage 1 starts at max(2 + 2, 6) = 6, ends 8, 10, .. 18;
    # stage 2 at 10 -> 12 .. 22; stage 3 at 14 -> 16 .. 26.
    d = placed(pol.place(req(64), {"n3": 4}))
    assert d.cpp_stages == ("p3", "p0", "p1", "p2")
    assert d.prefix_blocks == 4 and d.prefix_tokens == 16
    assert d.cpp_stage_end_s == (12.0, 18.0, 22.0, 26.0)
    assert d.est_transfer_s == 0.0 and d.est_prefill_s == 26.0 and d.est_ttft_s == 26.0
    assert LIN.prefill_time(64, 16) == 48.0  # p3 alone


def test_a_report_covers_only_its_own_members_stage():
    pol, clock = make_policy()
    placed(pol.place(req(8), {}))
    clock.advance(5.0)
    pol.observe_prefill(pload("p0", "n0", 0.0, ts=5.0))  # p0 is done with its stage
    assert pol.queue_s("p0") == 0.0 and pol.queue_s("p1") == 7.0
    assert pol.dispatched() == ["r1"]
    pol.prefill_done("r1")
    assert pol.queue_s("p1") == 0.0


def test_release_drops_every_members_work():
    pol, _ = make_policy()
    placed(pol.place(req(8), {}))
    pol.release("r1")
    assert pol.queue_s("p0") == 0.0 and pol.queue_s("p1") == 0.0 and pol.dispatched() == []


def test_dead_member_breaks_the_group():
    pol, clock = make_policy(dead_after_s=2.0)
    clock.advance(3.0)
    pol.observe_prefill(pload("p0", "n0", 0.0, ts=3.0))  # p1 silent: dead
    pol.observe_decode(
        DecodeLoad(
            instance="d0",
            node="m0",
            batch_size=0,
            waiting=0,
            max_batch=8,
            kv_tokens=0,
            step_time_s=0.0,
            ts=3.0,
        )
    )
    d = placed(pol.place(req(8), {}))
    assert d.cpp_stages == () and d.prefill_instance == "p0"
    # and an excluded member (a refused store) breaks it too
    pol.observe_prefill(pload("p1", "n1", 0.0, ts=3.0))
    d = placed(pol.place(req(8, rid="r2"), {}, exclude_prefill=["p1"]))
    assert d.cpp_stages == ()


def test_groups_off_and_load_strategy_never_pipeline():
    pol, _ = make_policy(group=1)
    assert placed(pol.place(req(8), {})).cpp_stages == ()
    pol, _ = make_policy(strategy="load")
    assert placed(pol.place(req(8), {})).cpp_stages == ()


def test_an_slo_the_group_cannot_meet_is_still_rejected():
    pol, _ = make_policy()
    d = pol.place(PlacementRequest("r1", 8, tuple(range(2)), BS, ttft_slo_s=6.0), {})
    assert isinstance(d, Rejection) and "7.000s" in d.reason


def test_a_short_request_runs_between_a_pipelines_chunks_a_longer_one_waits_for_it():
    # r1 pipelines on (p0, p1): stage ends at 4 and 7 s; p2 is on its own (3 instances)
    pol, clock = make_policy(works=(0.0, 0.0, 0.0), min_tokens=8)
    assert placed(pol.place(req(8), {})).cpp_stages == ("p0", "p1")
    assert pol.in_pipeline("p0") and pol.in_pipeline("p1") and not pol.in_pipeline("p2")
    clock.advance(1.0)
    # reports at 1 s: p0 has 1 s of its chunk left, p1 waits for its first input, p2 is
    # busy for 5 s with other work
    for i, w in enumerate((1.0, 0.0, 5.0)):
        pol.observe_prefill(pload(f"p{i}", f"n{i}", w, ts=1.0))
    # 4 tokens (interleave_tokens): it waits only for what the members report queued
    d = placed(pol.place(req(4, rid="short", hashes=(1,)), {}))
    assert d.prefill_instance == "p1" and d.est_queue_s == 0.0 and d.est_ttft_s == 4.0
    # 6 tokens: it also waits for the stages still to run (p0: 4 - 1 s, p1: 7 - 1 s,
    # on top of the reports, which count the chunk in progress too)
    assert pol.queue_s("p0") == 4.0 and pol.queue_s("p1") == 4.0 + 6.0
    assert pol.queue_s("p0", interleave=True) == 1.0
    d = placed(pol.place(req(6, rid="longer", hashes=(2,)), {}))
    assert d.prefill_instance == "p0" and d.est_queue_s == 4.0 and d.est_ttft_s == 10.0
    # once r1's first token is out its stages count no more
    pol.prefill_done("r1")
    assert not pol.in_pipeline("p1") and pol.queue_s("p1") == 4.0  # the short one


def test_on_a_tie_a_short_request_keeps_off_a_pipeline():
    pol, _ = make_policy(works=(0.0, 0.0, 0.0), min_tokens=8)
    placed(pol.place(req(8), {}))
    for i in range(3):
        pol.observe_prefill(pload(f"p{i}", f"n{i}", 0.0))
    # p0 and p1 report nothing queued (p1 waits for input): all three tie at 4 s
    d = placed(pol.place(req(4, rid="short", hashes=(1,)), {}))
    assert d.prefill_instance == "p2" and d.est_ttft_s == 4.0
    # and a release drops the pipeline too
    pol.release("r1")
    assert not pol.in_pipeline("p0") and pol.queue_s("p0") == 0.0


def test_a_pipelines_ttft_feedback_is_its_groups_not_its_anchors():
    from services.conductor.placement_policy import TtftFeedback

    pol, clock = make_policy(feedback=TtftFeedback())
    d = placed(pol.place(req(8), {}))
    assert d.cpp_stages == ("p0", "p1") and d.est_ttft_s == 7.0
    clock.advance(14.0)
    pol.prefill_done("r1")  # observed 14 s for 7 predicted
    fb = pol.feedback
    assert fb is not None and fb.factors == {"cpp:p0+p1": 2.0}
    for i in range(2):
        pol.observe_prefill(pload(f"p{i}", f"n{i}", 0.0, ts=14.0))
    pol.observe_decode(
        DecodeLoad(
            instance="d0",
            node="m0",
            batch_size=0,
            waiting=0,
            max_batch=8,
            kv_tokens=0,
            step_time_s=0.0,
            ts=14.0,
        )
    )
    # the group now predicts 14 s and loses to p0 alone (8 s, its own factor still 1)
    d = placed(pol.place(req(8, rid="r2"), {}))
    assert d.cpp_stages == () and d.prefill_instance == "p0" and d.est_ttft_s == 8.0
