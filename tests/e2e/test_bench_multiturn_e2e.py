"""``perigee bench multiturn`` at its smallest: one two-turn conversation of tiny-llama
against the perigee stack and plain vLLM's server. Every figure is measured, and the
second turn reuses the first turn's prompt on both (tiny-llama's random weights make
the answer's text arbitrary, so only the prompt's blocks are certain). No timing is
asserted."""

import importlib.util

import pytest

from tests.unit.perigee.test_bench_figures import assert_measured, run_bench

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (make install-vllm)"
    ),
]


def test_the_bench_reports_finite_figures(tmp_path):
    out = run_bench(
        tmp_path,
        "multiturn",
        "--model",
        "tiny-llama",
        "--conversations",
        "1",
        "--turns",
        "2",
        "--answer-tokens",
        "8",
        "--loads",
        "1",
        "--ttft-slo",
        "1000",
        "--tbt-slo",
        "1000",
        "--log-dir",
        str(tmp_path / "logs"),
    )
    runs = out["runs"]
    assert [(r["system"], r["turn"]) for r in runs] == [
        ("perigee", 1),
        ("perigee", 2),
        ("vllm", 1),
        ("vllm", 2),
    ]
    for r in runs:
        assert r["completed"] == r["requests"] == r["good"] == 1, r
        assert_measured(r, "ttft_p50_s", "ttft_p90_s", "cached_ratio")
    first = {r["system"]: r for r in runs if r["turn"] == 1}
    for r in runs:
        if r["turn"] == 2:
            assert r["cached_tokens"] >= first[r["system"]]["prompt_tokens"] // 32 * 32 - 32, r
