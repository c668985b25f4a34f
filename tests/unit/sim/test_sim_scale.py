"""The simulator at scale: reports per decision follow the changes, not the cluster,
and give exactly what reporting every instance gives; the trace copies of
``perigee sim repro scale``."""

import gc
import json
import random
from unittest.mock import patch

import pytest

from perigee.sim import repro
from perigee.sim.scale import replicate
from perigee.sim.simulator import SimConfig, Simulator
from perigee.trace import TraceRequest


def random_trace(n: int, seed: int, prefixes: int = 6) -> list[TraceRequest]:
    """Bursts of arrivals (several at one timestamp, as the conversation trace has,
    and gaps shorter than the keep-alive, so that a missed change would show)
    sharing a few prefixes, lengths and outputs spread wide."""
    rng = random.Random(seed)
    out, t, next_id = [], 0.0, 1000
    heads = [tuple(range(p * 10, p * 10 + rng.randint(1, 5))) for p in range(prefixes)]
    while len(out) < n:
        t += rng.choice((0.0, 0.0, 0.05, 0.2, 0.7))
        head = rng.choice(heads)
        own = tuple(range(next_id, next_id + rng.randint(0, 6)))
        next_id += len(own)
        ids = head + own
        out.append(TraceRequest(t, len(ids) * 512 - rng.randint(0, 300), rng.randint(1, 400), ids))
    return out


def outcome(sim: Simulator) -> list[tuple]:
    return [
        (
            r.rid,
            r.state,
            r.prefill_instance,
            r.decode_instance,
            r.first_token,
            r.finished,
            r.tbt_s,
            r.cached_tokens,
            r.pulled_tokens,
            r.reject_stage,
            r.reject_reason,
        )
        for r in sim.requests
    ]


CONFIGS = [
    {},
    {"speed": 20.0},  # overloaded: rejections at admission and placement
    {"admission": "baseline", "speed": 20.0},  # decode-side rejections
    {"policy": "load"},
    {"policy": "random", "speed": 8.0},
    {"pd_controller": True, "speed": 8.0, "pd_kw": {"interval_s": 5.0, "min_samples": 2}},
    {"cache_tokens_per_node": 4 * 512, "speed": 8.0},  # stores short of room: waits
]


@pytest.mark.parametrize("extra", CONFIGS)
@pytest.mark.parametrize("seed", [1, 2])
def test_incremental_reports_decide_exactly_as_reporting_every_instance(extra, seed):
    trace = random_trace(150, seed)
    runs = {}
    for incremental in (False, True):
        cfg = SimConfig(prefill=6, decode=5, incremental_reports=incremental, seed=seed, **extra)
        sim = Simulator(trace, cfg).run()
        assert sim._incremental is incremental
        runs[incremental] = outcome(sim)
    assert runs[True] == runs[False]
    assert any(r[1] == "DONE" for r in runs[True])


def count_reports(sim: Simulator) -> list[int]:
    """Reports handed to placement at each decision."""
    per: list[int] = []
    observe, admit = sim.placement.observe_prefill, sim._admit
    observe_d = sim.placement.observe_decode
    sim.placement.observe_prefill = lambda load: (per.__setitem__(-1, per[-1] + 1), observe(load))[
        1
    ]  # type: ignore[method-assign]
    sim.placement.observe_decode = lambda load: (per.__setitem__(-1, per[-1] + 1), observe_d(load))[
        1
    ]  # type: ignore[method-assign]

    def admit_counting(req):
        per.append(0)
        admit(req)

    sim._admit = admit_counting  # type: ignore[method-assign]
    sim.run()
    return per


def test_a_decision_reports_what_changed_not_the_cluster():
    # One request every 0.3 s on 40 + 40 instances: after the first sweep a decision
    # reports the instances the last request touched (its prefill and decode) and
    # those whose load moves with time, and every instance at most once a keep-alive
    # (half of dead_after_s: 1 s).
    trace = [TraceRequest(0.3 * i, 600, 3, (i,)) for i in range(12)]
    sim = Simulator(trace, SimConfig(prefill=40, decode=40))
    per = count_reports(sim)
    assert sim._incremental
    sweeps = [i for i, n in enumerate(per) if n == 80]
    assert sweeps and sweeps[0] == 0
    # one sweep per keep-alive: decisions 0.3 s apart, so every 4th at the most
    assert all(b - a >= 3 for a, b in zip(sweeps, sweeps[1:], strict=False))
    assert max(n for i, n in enumerate(per) if i not in sweeps) <= 4
    full = Simulator(trace, SimConfig(prefill=40, decode=40, incremental_reports=False))
    assert count_reports(full) == [80] * 12
    assert outcome(full) == outcome(sim)


def test_a_run_keeps_the_collector_off_what_existed_before_it():
    """While it runs, what existed before (trace, requests, cluster) is frozen out of
    the cyclic collector's scans and a young collection waits for 50,000 new objects
    (a large run's full collections would scan its whole heap); both restored after."""
    before = gc.get_threshold()
    sim = Simulator(random_trace(20, 0), SimConfig(prefill=2, decode=2))
    seen: list[tuple[int, int]] = []
    sim.hooks.append(lambda: seen.append((gc.get_threshold()[0], gc.get_freeze_count())))
    sim.run()
    assert seen and all(t >= 50_000 and frozen > 0 for t, frozen in seen)
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


def test_a_runs_requests_and_copies_are_built_with_the_collector_paused():
    """No collection while a trace's requests are built (a full one would scan every
    request built so far) nor while replicate builds copies; on again after, and left
    off where the caller had it off."""
    assert gc.isenabled()
    built: list[bool] = []
    real = Simulator._request

    def request(self, *a):  # type: ignore[no-untyped-def]
        built.append(gc.isenabled())
        return real(self, *a)

    with patch.object(Simulator, "_request", request):
        Simulator(random_trace(20, 0), SimConfig(prefill=2, decode=2))
    assert len(built) == 20 and not any(built) and gc.isenabled()
    copied: list[bool] = []

    def copy(*a):  # type: ignore[no-untyped-def]
        copied.append(gc.isenabled())
        return TraceRequest(*a)

    with patch("perigee.sim.scale.TraceRequest", copy):
        replicate(random_trace(5, 0), 3)
    assert len(copied) == 10 and not any(copied) and gc.isenabled()
    gc.disable()
    try:
        Simulator(random_trace(5, 0), SimConfig(prefill=2, decode=2))
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_incremental_reports_stay_off_where_a_report_is_not_idempotent():
    trace = random_trace(5, 0)
    assert not Simulator(trace, SimConfig(admission="predict"))._incremental_ok()
    assert not Simulator(trace, SimConfig(report_interval_s=0.1))._incremental_ok()
    assert not Simulator(trace, SimConfig(cpp_group=2))._incremental_ok()
    grace = SimConfig(placement_kw={"report_grace_s": 0.5})
    assert not Simulator(trace, grace)._incremental_ok()
    assert Simulator(trace, SimConfig())._incremental_ok()


def test_replicate_offsets_hash_ids_per_copy_and_merges_by_time():
    trace = [TraceRequest(0.0, 1024, 5, (0, 1)), TraceRequest(2.0, 512, 3, (0, 7))]
    out = replicate(trace, 3)
    assert [(r.timestamp_s, r.hash_ids) for r in out] == [
        (0.0, (0, 1)),
        (0.0, (8, 9)),
        (0.0, (16, 17)),
        (2.0, (0, 7)),
        (2.0, (8, 15)),
        (2.0, (16, 23)),
    ]
    assert {(r.input_length, r.output_length) for r in out[3:]} == {(512, 3)}
    with pytest.raises(ValueError):
        replicate(trace, 0)


def test_repro_scale_records_the_curve(tmp_path):
    trace_path = tmp_path / "t.jsonl"
    with open(trace_path, "w") as f:
        for r in random_trace(60, 3):
            row = {
                "timestamp": r.timestamp_s * 1000,
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": list(r.hash_ids),
            }
            f.write(json.dumps(row) + "\n")
    argv = ["scale", "--trace", str(trace_path), "--out", str(tmp_path), "--copies", "2"]
    assert repro.main([*argv, "--prefill", "2", "--decode", "1", "--no-dynamo", "--reference"]) == 0
    res = json.loads((tmp_path / "sim_scale.json").read_text())
    pts = res["points"]
    assert [(p["copies"], p["prefill"], p["decode"], p["requests"]) for p in pts] == [
        (1, 2, 1, 60),
        (2, 4, 2, 120),
    ]
    assert pts[0]["wall_ratio"] == 1.0
    for p in pts:
        assert set(p["wall_split_s"]) == {"reports", "admission", "placement", "rest"}
        assert sum(p["wall_split_s"].values()) == pytest.approx(p["wall_s"], rel=1e-6)
        assert p["reference"]["same"]  # the full scans decide alike
    assert (tmp_path / "sim_scale.png").stat().st_size > 0


def test_repro_scale_refuses_bad_copies(tmp_path):
    with pytest.raises(SystemExit):
        repro.main(["scale", "--out", str(tmp_path), "--copies", "two"])
    with pytest.raises(SystemExit):
        repro.main(["fig5", "--out", str(tmp_path), "--copies", "2"])


def test_perigee_sim_copies_the_trace(tmp_path):
    from perigee.sim import cli

    path = tmp_path / "t.jsonl"
    with open(path, "w") as f:
        for r in random_trace(40, 4):
            row = {
                "timestamp": r.timestamp_s * 1000,
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": list(r.hash_ids),
            }
            f.write(json.dumps(row) + "\n")
    out = tmp_path / "s.json"
    argv = ["--trace", str(path), "--prefill", "4", "--decode", "4", "--no-progress"]
    registered: list = []
    with patch("perigee.sim.gc_policy.atexit.register", registered.append):
        assert cli.main([*argv, "--copies", "3", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["requests"] == 120
    # What is left is frozen at exit, not collected (the last full collection of a
    # large run's heap only for the process to end).
    assert registered == [gc.freeze]
    assert cli.main([*argv, "--copies", "0"]) == 2
