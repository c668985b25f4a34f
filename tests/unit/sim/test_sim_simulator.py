"""The simulator end to end on hand-built traces, with a toy cost model whose times are
easy to follow: exact prefix hits through the real BlockPool + PrefixIndex, the remote
pull of global scheduling, wasted prefill under baseline admission, and proof that the
very policy classes decide."""

import math
from dataclasses import replace

import pytest

from perigee.sim.metrics import summarize
from perigee.sim.simulator import SimConfig, Simulator, simulate
from perigee.trace import TraceRequest
from services.admission.admission_policy import EarlyRejectionPolicy
from services.common.cost_model import CostModel
from services.conductor.placement_policy import PlacementPolicy

# prefill 0.05 s/token, decode step = context tokens / 1000 s, KV 1 byte/token, free links
TOY = CostModel(
    layers=1,
    d=1,
    a=0.0,
    b=1.0,
    gqa=2,
    elem_bytes=1,
    gpu_flops=20.0,
    hbm_bw=1000.0,
    weight_bytes=0.0,
    nic_bw=math.inf,
)
FAST = CostModel(
    layers=1,
    d=1,
    a=0.0,
    b=1.0,
    gqa=2,
    elem_bytes=1,
    gpu_flops=1e4,
    hbm_bw=1e6,
    weight_bytes=0.0,
    nic_bw=math.inf,
)
PULL = CostModel(
    layers=1,
    d=1,
    a=0.0,
    b=1.0,
    gqa=2,
    elem_bytes=1,
    gpu_flops=2000.0,
    hbm_bw=1e6,
    weight_bytes=0.0,
    nic_bw=math.inf,
)
B = 512


def tr(t: float, n: int, out: int, ids: tuple[int, ...] = ()) -> TraceRequest:
    return TraceRequest(t, n, out, ids)


def run(trace, **kw) -> Simulator:
    cfg = SimConfig(**{"prefill": 1, "decode": 1, "cost": FAST, **kw})
    return Simulator(trace, cfg).run()


def test_second_request_hits_exactly_the_shared_prefix():
    sim = run([tr(0.0, 3 * B + 10, 1, (1, 2, 3, 4)), tr(10.0, 3 * B + 10, 1, (1, 2, 9, 10))])
    r0, r1 = sim.requests
    assert (r0.cached_tokens, r1.cached_tokens) == (0, 2 * B)
    assert r1.compute_s == FAST.prefill_time(3 * B + 10, 2 * B)
    assert sim.cluster.index.match([1, 2, 9]) == {"n00": 3, "n01": 3}  # prefill + decode stores
    s = summarize(sim)
    assert s["cache_hit_rate"] == 2 * B / (2 * (3 * B + 10))
    assert (s["completed"], s["rejected"]) == (2, 0)


def test_global_policy_pulls_the_prefix_to_an_idle_node_and_replicates_it():
    trace = [
        tr(0.0, 4 * B, 1, (1, 2, 3, 4)),  # n00 (tie -> first instance), done at 1.024
        tr(1.5, 40 * B, 1, tuple(range(100, 140))),  # n00 again: busy until 11.74
        tr(2.0, 4 * B, 1, (1, 2, 3, 5)),  # n00 holds 3 blocks but is busy: pull to n01
    ]
    sim = run(trace, prefill=2, decode=1, decode_cache_tokens=0, cost=PULL)
    r0, r1, r2 = sim.requests
    assert (r0.prefill_node, r1.prefill_node) == ("n00", "n00")
    assert r2.prefill_node == "n01"
    assert (r2.pull_source, r2.pulled_tokens, r2.cached_tokens) == ("n00", 3 * B, 3 * B)
    assert sim.cluster.index.match([1, 2, 3]) == {"n00": 3, "n01": 3}


def test_local_policy_never_pulls():
    trace = [
        tr(0.0, 4 * B, 1, (1, 2, 3, 4)),
        tr(1.5, 40 * B, 1, tuple(range(100, 140))),
        tr(2.0, 4 * B, 1, (1, 2, 3, 5)),
    ]
    sim = run(trace, prefill=2, decode=1, decode_cache_tokens=0, cost=PULL, policy="local")
    r0, r1, r2 = sim.requests
    assert (r2.prefill_node, r2.pulled_tokens, r2.cached_tokens) == ("n01", 0, 0)


# A long-output request whose context grows until a short one, admissible when it
# arrives at t=4.02 (predicted step (75 + 20) / 1000 = 0.095 s), lands on decode at
# 5.02 when the prediction is (87 + 20) / 1000 = 0.107 s > 0.1; a third at t=6 is over
# the SLO already when it arrives. Baseline: the decode instance rejects after the prefill
# (DecodeSideCheck); early: admission rejects at the door.
OVERLOAD = [tr(0.0, 50, 1000), tr(4.02, 20, 5), tr(6.0, 20, 5)]


def test_baseline_rejects_after_prefill_and_wastes_it():
    sim = run(OVERLOAD, admission="baseline", cost=TOY)
    r0, r1, r2 = sim.requests
    assert r0.state == "DONE"
    assert (r1.state, r1.reject_stage) == ("REJECTED", "decode")
    assert r1.prefill_end == pytest.approx(5.02) and r1.compute_s == 1.0
    # the conductor does not check TBT under baseline: r2 is prefilled, then rejected too
    assert (r2.state, r2.reject_stage) == ("REJECTED", "decode")
    assert r2.prefill_end == pytest.approx(7.0)
    s = summarize(sim)
    assert s["rejected_by"] == {"admission": 0, "conductor": 0, "decode": 2}
    assert s["prefill_gpu_s"]["wasted"] == 2.0
    assert sim.placement.dispatched() == []


def test_early_rejection_rejects_before_prefill():
    sim = run(OVERLOAD, admission="early", cost=TOY)
    r0, r1, r2 = sim.requests
    assert (r0.state, r1.state) == ("DONE", "DONE")
    assert (r2.state, r2.reject_stage) == ("REJECTED", "admission")
    assert r2.compute_s == 0.0 and r2.prefill_end == -1.0
    s = summarize(sim)
    assert s["rejected_by"] == {"admission": 1, "conductor": 0, "decode": 0}
    assert s["prefill_gpu_s"]["wasted"] == 0.0


def test_ttft_is_prefill_plus_queue_on_the_cost_model():
    sim = run([tr(0.0, 20, 2), tr(0.0, 40, 2)], cost=TOY)
    r0, r1 = sim.requests
    assert r0.ttft_s == 1.0 and r1.ttft_s == 3.0  # FIFO on one prefill instance


class SpyPlacement(PlacementPolicy):
    calls: list[str] = []

    def place(self, req, matches, **kw):
        decision = super().place(req, matches, **kw)
        SpyPlacement.calls.append((req.request_id, dict(matches), type(decision).__name__))
        return decision


class SpyAdmission(EarlyRejectionPolicy):
    decided: list[str] = []

    def decide(self, req):
        SpyAdmission.decided.append(req.request_id)
        return super().decide(req)


def test_the_simulator_calls_the_live_policy_classes():
    SpyPlacement.calls, SpyAdmission.decided = [], []
    trace = [tr(0.0, 3 * B, 1, (1, 2, 3)), tr(5.0, 3 * B, 1, (1, 2, 7))]
    sim = Simulator(
        trace,
        SimConfig(prefill=2, decode=1, cost=FAST),
        placement_cls=SpyPlacement,
        admission=lambda name, clock, cost, **kw: SpyAdmission(clock, cost, **kw),
    )
    sim.run()
    assert isinstance(sim.placement, SpyPlacement) and isinstance(sim.admission, SpyAdmission)
    assert SpyAdmission.decided == ["r0", "r1"]
    assert SpyPlacement.calls == [
        ("r0", {}, "Placement"),
        ("r1", {"n00": 2, "n02": 2}, "Placement"),
    ]
    assert sim.placement.clock is sim.loop.clock is sim.admission.clock
    assert sim.placement.dispatched() == []  # every dispatch released at the end


def test_simulate_returns_the_summary_dict():
    s = simulate(
        [tr(0.0, 600, 3, (1, 2)), tr(0.5, 600, 3, (1, 3))],
        SimConfig(cost=FAST),
        prefill=2,
        decode=2,
        block_size=B,
    )
    for key in ("requests", "completed", "rejected", "cache_hit_rate", "wall_s"):
        assert key in s
    assert set(s["ttft_s"]) >= {"mean", "p50", "p99"} and set(s["tbt_s"]) >= {"mean", "p99"}
    assert (s["requests"], s["completed"]) == (2, 2)


def test_predict_admission_is_the_live_class_and_forgets_downstream_rejections():
    from services.admission.admission_policy import PredictiveRejectionPolicy

    # admission sees an idle cluster (no wait) and accepts; the conductor's TTFT estimate
    # (0.1 s of prefill) misses the 0.05 s SLO and rejects: admission must stop counting it
    sim = run([tr(0.0, 1000, 2)], admission="predict", ttft_slo_s=0.05)
    assert isinstance(sim.admission, PredictiveRejectionPolicy)
    assert (sim.requests[0].state, sim.requests[0].reject_stage) == ("REJECTED", "conductor")
    assert sim.admission.admitted == {}


def test_pd_controller_moves_an_idle_decode_node_to_prefill():
    # 2P2D; 2.5 s prompts flood the prefill pool, 1-token outputs leave decode idle. The
    # switched node drains the requests already placed on it (they land by ~30 s), then
    # serves prefill: the late requests spread over three prefill instances.
    trace = [tr(0.05 * i, 50, 1) for i in range(30)] + [
        tr(40.0 + 0.01 * i, 50, 1) for i in range(3)
    ]
    sim = Simulator(
        trace,
        SimConfig(
            prefill=2,
            decode=2,
            cost=replace(TOY, hbm_bw=1e5),
            pd_controller=True,
            pd_kw={
                "sample_s": 1.0,
                "interval_s": 2.0,
                "window_s": 4.0,
                "cooldown_s": 1e9,
                "min_samples": 2,
            },
        ),
    ).run()
    assert sim.resizer.switches == [(2.0, "n02", "decode", "prefill")]
    assert sorted(sim.prefills) == ["P-n00", "P-n01", "P-n02"] and sorted(sim.decodes) == ["D-n03"]
    assert sim.cluster.nodes["n02"].role == "prefill"
    assert [r.prefill_instance for r in sim.requests[-3:]] == ["P-n00", "P-n01", "P-n02"]
    assert [r.decode_instance for r in sim.requests[-3:]] == ["D-n03"] * 3
    sim.refresh(force=True)
    assert sim.placement.live_decode() == ["D-n03"]
    assert sim.placement.live_prefill() == ["P-n00", "P-n01", "P-n02"]


# TOY with a 10 bytes/s NIC: a 20-token prompt's KV (20 bytes, one layer) trails its
# 1 s prefill by 2 s.
SLOW_NIC = replace(TOY, nic_bw=10.0)


def test_first_token_streams_from_prefill_while_the_kv_is_on_the_wire():
    sim = run([tr(0.0, 20, 2)], cost=SLOW_NIC, first_token_hop_s=0.1)
    r = sim.requests[0]
    assert (r.prefill_end, r.first_token, r.ttft_s) == (1.0, 1.1, 1.1)
    # the KV lands at 3.0; one decode step of context 21: the only gap includes the wait
    assert r.join_time == 3.0 and r.finished == pytest.approx(3.021)
    assert r.tbt_s == pytest.approx(3.021 - 1.1)


def test_baseline_first_token_waits_for_decode_to_take_the_request():
    sim = run([tr(0.0, 20, 2)], cost=SLOW_NIC, admission="baseline", first_token_hop_s=0.1)
    r = sim.requests[0]
    assert r.state == "DONE" and r.ttft_s == pytest.approx(3.1)


def test_dispatch_and_handoff_delay_the_prefill_queue():
    sim = run(
        [tr(0.0, 20, 1), tr(0.0, 40, 1)],
        cost=TOY,
        dispatch_s=0.5,
        prefill_handoff_s=0.25,
        first_token_hop_s=0.1,
    )
    r0, r1 = sim.requests
    assert (r0.started, r0.prefill_end, r0.ttft_s) == (0.5, 1.5, 1.6)
    # r1 waits for r0's compute and handoff (1.75), then computes 2 s
    assert (r1.started, r1.prefill_end) == (1.75, 3.75)
    assert r1.ttft_s == pytest.approx(3.85)


def test_baseline_rejection_at_decode_keeps_the_prefill_nodes_blocks():
    # decode step with 522 tokens of context is 0.522 s > the 0.1 s TBT SLO
    sim = run([tr(0.0, B + 10, 2, (1, 2))], cost=TOY, admission="baseline")
    r = sim.requests[0]
    assert (r.state, r.reject_stage) == ("REJECTED", "decode")
    # FirstTokenNotice (sent by prefill once the KV landed) committed the prefill tx; the
    # decode node aborted its own
    assert sim.cluster.index.match([1]) == {"n00": 1}
    assert sim.placement.dispatched() == []


class ReportSpy(PlacementPolicy):
    reports: list[tuple[str, float]] = []
    seen: list[dict[str, float]] = []

    def observe_prefill(self, load):
        ReportSpy.reports.append((load.instance, load.ts))
        super().observe_prefill(load)

    def place(self, req, matches, **kw):
        ReportSpy.seen.append({i: p.ts for i, p in self._prefill.items()})
        return super().place(req, matches, **kw)


def test_load_reports_come_on_timers_and_decisions_see_the_last_one():
    ReportSpy.reports, ReportSpy.seen = [], []
    trace = [tr(0.0, 20, 1), tr(2.5, 20, 1), tr(5.0, 20, 1)]
    sim = Simulator(
        trace,
        SimConfig(prefill=2, decode=1, cost=TOY, report_interval_s=1.0),
        placement_cls=ReportSpy,
    ).run()
    assert all(r.state == "DONE" for r in sim.requests)
    for inst in ("P-n00", "P-n01"):
        times = [t for i, t in ReportSpy.reports if i == inst]
        assert times[0] == 0.0 and 0.0 <= times[1] <= 1.0  # at the first arrival, then a phase
        assert [b - a for a, b in zip(times[1:], times[2:], strict=False)] == pytest.approx(
            [1.0] * (len(times) - 2)
        )
        assert times[-1] <= sim.requests[-1].finished  # the timers stop when all is done
    # a decision sees each instance's latest report, at most one interval old
    for at, seen in zip((0.0, 2.5, 5.0), ReportSpy.seen, strict=True):
        for inst, ts in seen.items():
            assert ts == max(t for i, t in ReportSpy.reports if i == inst and t <= at)
            assert at - 1.0 < ts <= at


def test_cli_report_interval_gives_the_policies_stale_views(tmp_path, monkeypatch):
    import json

    from perigee.sim import cli
    from perigee.sim import simulator as sim_mod

    seen = {}

    class Spy(sim_mod.Simulator):
        def __init__(self, trace, cfg, **kw):
            seen["cfg"] = cfg
            super().__init__(trace, cfg, **kw)

    monkeypatch.setattr(sim_mod, "Simulator", Spy)
    out = tmp_path / "s.json"
    assert (
        cli.main(
            [
                "--limit",
                "30",
                "--prefill",
                "2",
                "--decode",
                "1",
                "--report-interval",
                "0.1",
                "--no-progress",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    cfg = seen["cfg"]
    assert cfg.report_interval_s == 0.1 and cfg.placement_kw == {"report_grace_s": 0.05}
    assert json.loads(out.read_text())["completed"] == 30
