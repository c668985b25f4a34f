"""Every ``perigee bench`` that starts a serving stack still measures: each run through
``perigee bench <name>`` at the smallest size its flags allow (the mock engine where
there is a choice, tiny-llama where vLLM is the point, a request or a trial or two)
exits 0 and reports its figures as finite numbers. ``bench migration`` once printed
NaN for every figure (its bus tap watched a subject the gateway no longer sent on)
while the migrations themselves worked: these tests catch that kind of breakage, not
slowness (no timing is asserted).

chaos and agreement have e2e tests of their own (tests/e2e/test_chaos.py,
tests/e2e/test_live_vs_sim.py), which check their figures too; the benches without a
stack are in tests/unit/perigee/test_bench_figures.py."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from perigee import bench
from perigee.bench.stats import unmeasured

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (make install-vllm)"
)


def run_bench(tmp_path: Path, name: str, *args: str) -> dict:
    """``perigee bench <name> <args> --log-dir ... --json PATH`` in this process: exit 0."""
    path = tmp_path / f"{name}.json"
    argv = [name, *args, "--log-dir", str(tmp_path / "logs"), "--json", str(path)]
    assert bench.main(argv) == 0
    return json.loads(path.read_text())


def assert_measured(result: object, *patterns: str) -> None:
    bad = unmeasured(result, *patterns)
    assert not bad, f"not measured: {bad}"


def test_pipeline(tmp_path):
    out = run_bench(
        tmp_path,
        "pipeline",
        "--requests",
        "5",
        "--rate",
        "20",
        "--warmup",
        "1",
        "--rtt-samples",
        "5",
        "--paced-rtt-samples",
        "3",
    )
    assert out["failed"] == 0
    assert out["machine"]["cores"] >= 1
    assert_measured(out, "ttft_ms.*", "nats_rtt_ms.*", "nats_rtt_paced_ms.*")
    assert_measured(out, "ttft_over_nats_rtt_p50", "ttft_over_paced_rtt_p50")


def test_migration(tmp_path):
    """One trial: the decode instance serving a stream is SIGKILLed after 4 tokens; the
    bench must see the migrated request and time it (exit 1 on a NaN figure)."""
    out = run_bench(
        tmp_path,
        "migration",
        "--trials",
        "1",
        "--prompt-tokens",
        "512",
        "--max-tokens",
        "32",
        "--kill-after",
        "4",
    )
    assert out["migrated_trials"] == 1 and not out["failures"], out
    assert_measured(out, "detection_ms.*", "migration_ms.*", "reprefill_ms.*", "stall_ms.*")
    assert_measured(out, "migration_over_reprefill_p50")
    [row] = out["rows"]
    assert row["resumed_tokens"] >= 4 and row["context_tokens"] == 512 + row["resumed_tokens"]
    # The migrated request took the prompt's KV from a store instead of computing it.
    assert out["kv_tokens_pulled"] > 0 and out["migrated_requests_counted"] == 1, out


@needs_vllm
def test_slo(tmp_path):
    """Both systems (the perigee stack and plain vLLM's server) on tiny-llama, two
    requests at one speed; SLOs out of reach of a slow box, so nothing is refused."""
    out = run_bench(
        tmp_path,
        "slo",
        "--model",
        "tiny-llama",
        "--limit",
        "2",
        "--speeds",
        "4",
        "--max-output",
        "4",
        "--ttft-slo",
        "1000",
        "--tbt-slo",
        "1000",
    )
    assert [r["system"] for r in out["runs"]] == ["perigee", "vllm"]
    for r in out["runs"]:
        assert r["completed"] == r["requests"] == 2, r
        assert_measured(r, "ttft_p50_s", "ttft_p90_s", "tbt_p90_s", "good_per_s", "wall_s")


@needs_vllm
def test_reuse(tmp_path):
    """One cold/hit90 pair and four trace requests on tiny-llama, perigee beside plain
    vLLM. In a child process: the bench loads a vLLM engine in its own process and sets
    vLLM's environment there."""
    path = tmp_path / "reuse.json"
    argv = [
        *("--reps", "1", "--warmup", "0", "--requests", "4"),
        *("--store-capacity-blocks", "1024", "--log-dir", str(tmp_path / "logs")),
        *("--json", str(path)),
    ]
    run = subprocess.run(
        [sys.executable, "-m", "perigee.cli", "bench", "reuse", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = json.loads(path.read_text())
    assert_measured(out, "ttft_s.cold", "ttft_s.hit90", "ttft_s.vllm_hit90", "cached_ratio.*")
    assert_measured(out, "details.vllm_cold_s", "details.ttft_samples_s.*")
    assert out["details"]["trace"]["perigee_failed"] == 0
    # The hit90 prompt found its cold twin's blocks on both sides.
    assert all(n > 0 for n in out["details"]["hit90_cached_tokens"].values()), out["details"]


def test_capacity_ab(tmp_path):
    """This tree against itself, one rate, one round: each stack measured once, every
    figure a number."""
    out = run_bench(
        tmp_path,
        "capacity-ab",
        *("--against", str(ROOT), "--rates", "5", "--rounds", "1"),
        *("--step-s", "1", "--warmup", "2"),
    )
    for side in ("this", "against"):
        [m] = out["medians"][side]
        assert (m["rate_rps"], m["rounds"], m["errors"]) == (5.0, 1, 0)
        [s] = out["steps"][side]
        assert s["ok"] == s["sent"] == 5
    assert_measured(out, "medians.*.*.p50_ms", "medians.*.*.cpu_ms_per_request")
    assert_measured(out, "paced_round_trip.latency_ms.p50")


def test_capacity(tmp_path):
    """One layout, one rate, a p99 bound no run misses: the step is held (no error but
    429) and every figure, the bus's own request/reply rate too, is a number."""
    out = run_bench(
        tmp_path,
        "capacity",
        *("--rates", "5", "--step-s", "1", "--layouts", "1x1", "--warmup", "2"),
        *("--nats-clients", "1", "--nats-s", "0.5", "--p99-ms", "1e9"),
    )
    assert out["machine"]["cores"] >= 1 and out["machine"]["kernel"]
    [layout] = out["layouts"]
    assert (layout["conductors"], layout["admissions"]) == (1, 1)
    assert layout["held_rps"] == 5
    [s] = layout["steps"]
    assert not s["errors"]
    assert_measured(layout, "nats_request_reply.*", "steps.*.overhead_ms.*")
