"""perigee bench capacity-ab: which stack each step measures first, the medians over
the rounds, and the other tree's services started from that tree."""

from pathlib import Path

import pytest

from perigee import stack as stack_mod
from perigee.bench.capacity import Step
from perigee.bench.capacity_ab import SIDES, main, medians, order
from perigee.stack import ROOT, Child, Stack, StackConfig


def test_the_order_alternates_from_step_to_step_and_between_rounds():
    assert [order(0, i)[0] for i in range(4)] == ["this", "against", "this", "against"]
    assert [order(1, i)[0] for i in range(4)] == ["against", "this", "against", "this"]
    assert all(sorted(order(r, i)) == sorted(SIDES) for r in range(3) for i in range(3))


def test_medians_are_per_side_and_rate_over_the_rounds():
    def step(rate, p50_s, cpu_s, errors=None):
        return Step(
            rate, 2, ok=2, overhead_s=[p50_s, p50_s], cpu_s={"x": cpu_s}, errors=errors or {}
        )

    steps = {
        "this": [step(50, 0.004, 0.02), step(50, 0.006, 0.03), step(50, 0.005, 0.01)],
        "against": [step(50, 0.008, 0.04), step(100, 0.003, 0.02, {"500": 1})],
    }
    m = medians(steps, [50.0, 100.0])
    assert [(r["rate_rps"], r["rounds"], r["p50_ms"]) for r in m["this"]] == [(50.0, 3, 5.0)]
    assert m["this"][0]["cpu_ms_per_request"] == 10.0  # 20 ms of CPU, 2 requests
    assert [(r["rate_rps"], r["p50_ms"], r["errors"]) for r in m["against"]] == [
        (50.0, 8.0, 0),
        (100.0, 3.0, 1),
    ]


def test_the_other_trees_services_run_from_that_tree(tmp_path, monkeypatch):
    seen = []

    def popen(argv, cwd, env, **kw):
        seen.append((cwd, env["PYTHONPATH"]))
        raise RuntimeError("not started")  # only the command line is checked

    monkeypatch.setattr(stack_mod.subprocess, "Popen", popen)
    for root, want in (("", ROOT), (str(tmp_path), tmp_path.resolve())):
        st = Stack(StackConfig(log_dir=str(tmp_path / "logs"), code_root=root))
        try:
            st._spawn(Child("gateway", ["services.gateway"]))
        except RuntimeError:
            pass
        assert seen[-1] == (Path(want), str(want))


def test_a_tree_that_is_not_perigee_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--against", str(tmp_path)])
    assert e.value.code == 2 and "not a perigee tree" in capsys.readouterr().err
