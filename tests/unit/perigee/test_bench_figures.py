"""Every ``perigee bench`` still measures: each bench that needs no serving stack, run
through ``perigee bench <name>`` at the smallest size its flags allow, reports its
figures as finite numbers (a NaN or None figure is a bench whose way of seeing what it
times broke, as ``bench migration``'s bus tap once did). No timing is asserted.

The benches that start a stack are in ``tests/e2e/test_bench_figures_e2e.py``
(pipeline, migration, slo, reuse) and in the e2e tests of their own (chaos, agreement);
``COVERED`` says where each bench's test is, so a new bench needs one.

Mooncake's baselines run where a Python that imports ``mooncake`` is found (as the
benches search for it) and are otherwise reported unavailable, with the reason."""

import json
from pathlib import Path

from perigee import bench
from perigee.bench.stats import leaves, unmeasured

ROOT = Path(__file__).resolve().parents[3]

COVERED = {
    "conductor": "tests/unit/sim/test_sim_bench_conductor.py::test_the_cli_reports_finite_figures",
    "calibration": "tests/unit/perigee/test_bench_figures.py::test_calibration",
    "transfer": "tests/unit/perigee/test_bench_figures.py::test_transfer",
    "store": "tests/unit/perigee/test_bench_figures.py::test_store",
    "ship": "tests/unit/perigee/test_bench_figures.py::test_ship",
    "pipeline": "tests/e2e/test_bench_figures_e2e.py::test_pipeline",
    "migration": "tests/e2e/test_bench_figures_e2e.py::test_migration",
    "slo": "tests/e2e/test_bench_figures_e2e.py::test_slo",
    "reuse": "tests/e2e/test_bench_figures_e2e.py::test_reuse",
    "chaos": "tests/e2e/test_chaos.py::test_a_chaos_run_loses_no_accepted_request",
    "agreement": "tests/e2e/test_live_vs_sim.py::test_the_bench_reports_finite_figures",
    "multiturn": "tests/e2e/test_bench_multiturn_e2e.py::test_the_bench_reports_finite_figures",
    "capacity": "tests/e2e/test_bench_figures_e2e.py::test_capacity",
    "capacity-ab": "tests/e2e/test_bench_figures_e2e.py::test_capacity_ab",
}


def run_bench(tmp_path: Path, name: str, *args: str) -> dict:
    """``perigee bench <name> <args> --json PATH``: its exit status must be 0; its JSON."""
    path = tmp_path / f"{name}.json"
    assert bench.main([name, *args, "--json", str(path)]) == 0
    return json.loads(path.read_text())


def assert_measured(result: object, *patterns: str) -> None:
    bad = unmeasured(result, *patterns)
    assert not bad, f"not measured: {bad}"


def baselines_ok_or_unavailable(rows: list[dict], measured: set[str], key: str) -> None:
    """Each of ``measured`` has rows, all with a finite ``key``; a row of another backend
    (Mooncake's) is either measured too or unavailable with its reason."""
    backends = {r.get("backend", r.get("system")) for r in rows}
    assert measured <= backends, backends
    for r in rows:
        who = r.get("backend", r.get("system"))
        if who in measured or r["status"] == "ok":
            assert r["status"] == "ok", r
            assert_measured(r, key)
        else:
            assert r["status"] == "unavailable" and r["reason"], r


def test_every_bench_has_a_figures_test():
    assert set(COVERED) == set(bench.BENCHES)
    for where in COVERED.values():
        path, _, test = where.partition("::")
        assert f"def {test}(" in (ROOT / path).read_text(), where


def test_unmeasured_names_what_is_not_a_finite_number():
    out = {"a": {"p50": 1.0, "p99": float("nan")}, "b": [{"x": None}, {"x": 2}], "c": True}
    assert dict(leaves(out)) == {
        "a.p50": 1.0,
        "a.p99": out["a"]["p99"],
        "b.0.x": None,
        "b.1.x": 2,
        "c": True,
    }
    assert unmeasured(out, "a.*") == ["a.p99=nan"]
    assert unmeasured(out, "b.*.x", "c", "d") == ["b.0.x=None", "c=True", "d: absent"]
    assert unmeasured(out, "a.p50", "b.1.x") == []


def test_calibration(tmp_path):
    out = run_bench(
        tmp_path,
        "calibration",
        "--engine",
        "mock",
        "--requests",
        "4",
        "--warmup",
        "1",
        "--max-len",
        "256",
        "--mock-speedup",
        "10",
    )
    [r] = out["runs"]
    assert r["engine"] == "mock" and r["requests"] == 4
    assert_measured(r, "*_median_abs_err", "*_p90_abs_err", "prefill_coef.*")
    assert_measured(r, "samples.*.measured_s", "samples.*.predicted_s")


def test_transfer(tmp_path):
    out = run_bench(tmp_path, "transfer", "--sizes-mib", "1", "--repeats", "1")
    measured = {"tcp", "raw_socket", "raw_socket_1thread", "shm", "memcpy"}
    baselines_ok_or_unavailable(out["results"], measured, "gbps")
    assert_measured(out["paired_ratios"], "*")
    for name in ("tcp_vs_raw_socket", "tcp_vs_raw_socket_1thread", "shm_vs_memcpy"):
        assert_measured(out["ratios"], f"{name}.*")


def test_store(tmp_path):
    out = run_bench(
        tmp_path, "store", "--sizes", "1024", "--ops", "5", "--warmup", "1", "--rounds", "1"
    )
    baselines_ok_or_unavailable(out["results"], {"perigee", "perigee-async"}, "p50_us")
    for r in out["results"]:
        if r["status"] == "ok":
            assert r["ops"] == 5, r
            assert_measured(r, "p99_us")


def test_ship(tmp_path):
    out = run_bench(tmp_path, "ship", "--tokens", "32", "--repeats", "1")
    baselines_ok_or_unavailable(out["results"], {"tcp", "shm", "raw_socket", "memcpy"}, "gbps")
    assert_measured(out, "paired_ratios.*", "with_open.*", "open_ms.*")
    for name in ("tcp_vs_raw_socket", "shm_vs_memcpy"):
        assert_measured(out["ratios"], f"{name}.*")
    # Each pair's bytes took the transport it stands for (its source store's counters).
    moved = out["bytes_by_transport"]
    assert moved["tcp"]["tcp"] > 0 and moved["shm"]["shm"] > 0, moved
