"""One admission mode (services.common.admission_mode): each service maps it to its own
behaviour, perigee up renders it once for every service that follows it, and the
settings that could split it (a flag against the environment, admission's old --policy)
are start-up errors."""

import argparse
import importlib
from types import SimpleNamespace

import pytest

from bus_schemas.requests import GenerateRequest
from perigee.sim.cli import admission_modes
from perigee.sim.simulator import SimConfig, Simulator
from perigee.stack import Stack
from perigee.up import parse as up_parse
from services.admission import __main__ as admission_main
from services.admission.admission_policy import (
    ADMISSION_POLICIES,
    BaselinePolicy,
    EarlyRejectionPolicy,
    PredictiveRejectionPolicy,
    make_admission_policy,
)
from services.common import admission_mode
from services.common.admission_mode import ENV, AdmissionMode
from services.common.clock import ManualClock
from services.common.cost_model import CostModel
from services.conductor import __main__ as conductor_main
from services.conductor.service import ConductorService
from services.decode import __main__ as decode_main
from services.prefill import __main__ as prefill_main
from services.worker.settings import settings_from_args

MODES = list(AdmissionMode)


@pytest.fixture(autouse=True)
def _no_mode_in_env(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)


def _error(capsys, fn, *a) -> str:
    with pytest.raises(SystemExit) as e:
        fn(*a)
    assert e.value.code == 2
    return capsys.readouterr().err


# -- resolving the one setting ----------------------------------------------------------


def test_flag_then_environment_then_early(monkeypatch):
    assert conductor_main.parse_args([]).admission_mode == AdmissionMode.EARLY
    monkeypatch.setenv(ENV, "baseline")
    assert conductor_main.parse_args([]).admission_mode == AdmissionMode.BASELINE
    assert conductor_main.parse_args(["--admission-mode=baseline"]).admission_mode == "baseline"
    monkeypatch.delenv(ENV)
    assert conductor_main.parse_args(["--admission-mode", "predict"]).admission_mode == "predict"


@pytest.mark.parametrize(
    "parse", [admission_main.parse_args, conductor_main.parse_args, decode_main.parse_args]
)
def test_a_flag_that_contradicts_the_environment_is_a_start_up_error(parse, monkeypatch, capsys):
    monkeypatch.setenv(ENV, "early")
    err = _error(capsys, parse, ["--admission-mode", "baseline"])
    assert "--admission-mode baseline contradicts $PERIGEE_ADMISSION_MODE early" in err


def test_an_unknown_mode_names_where_it_came_from(monkeypatch, capsys):
    err = _error(capsys, conductor_main.parse_args, ["--admission-mode", "eager"])
    assert (
        "--admission-mode: unknown admission mode 'eager'; one of baseline, early, predict" in err
    )
    monkeypatch.setenv(ENV, "strict")
    err = _error(capsys, prefill_main.parse_args, [])
    assert "$PERIGEE_ADMISSION_MODE: unknown admission mode 'strict'" in err


def test_admission_keeps_its_old_policy_flag_only_where_it_agrees(monkeypatch, capsys):
    assert admission_main.parse_args(["--policy", "predict"]).admission_mode == "predict"
    assert (
        admission_main.parse_args(["--policy=early", "--admission-mode=early"]).admission_mode
        == "early"
    )
    err = _error(capsys, admission_main.parse_args, ["--policy=early", "--admission-mode=baseline"])
    assert "contradicts --policy early" in err and "--policy is replaced by --admission-mode" in err
    monkeypatch.setenv(ENV, "baseline")
    err = _error(capsys, admission_main.parse_args, ["--policy=early"])
    assert "$PERIGEE_ADMISSION_MODE baseline contradicts --policy early" in err


def test_the_retired_flags_are_refused(capsys):
    assert "--tbt-check" in _error(capsys, conductor_main.parse_args, ["--tbt-check", "none"])
    assert "--tbt-gate-slo" in _error(capsys, decode_main.parse_args, ["--tbt-gate-slo", "1"])


# -- each service maps the mode to its behaviour ---------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_admission_runs_the_policy_of_the_mode(mode):
    cfg = admission_main.config_from_args(admission_main.parse_args(["--admission-mode", mode]))
    want = {
        AdmissionMode.BASELINE: BaselinePolicy,  # accepts everything at the door
        AdmissionMode.EARLY: EarlyRejectionPolicy,
        AdmissionMode.PREDICT: PredictiveRejectionPolicy,
    }[mode]
    assert type(make_admission_policy(cfg.policy, ManualClock(), CostModel())) is want


@pytest.mark.parametrize("mode", MODES)
def test_the_conductor_rejects_on_tbt_except_in_baseline(mode):
    cfg = conductor_main.config_from_args(conductor_main.parse_args(["--admission-mode", mode]))
    svc = ConductorService(None, cfg)
    assert svc.policy.tbt_check is (mode != AdmissionMode.BASELINE)
    # A prefill that may be refused by its decode instance does not stream the first
    # token (services.conductor.service: stream_first_token follows the TBT check).
    assert svc.cfg.tbt_check is (mode != AdmissionMode.BASELINE)


def _busy_decode() -> tuple[SimpleNamespace, SimpleNamespace]:
    req = GenerateRequest(request_id="r", prompt_token_ids=list(range(256)))
    stats = SimpleNamespace(batch_size=8, waiting=0, kv_tokens=8 * 2048, max_batch=128)
    return SimpleNamespace(request=req), stats


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("main", [prefill_main, decode_main])
def test_a_worker_gates_prefilled_requests_on_tbt_only_in_baseline(mode, main):
    """The gate is built for a prefill instance too (a switchable one may decode), and
    holds requests to the worker's own --tbt-slo."""
    tight = main.parse_args(["--admission-mode", mode, "--tbt-slo", "1e-9"])
    loose = main.parse_args(["--admission-mode", mode, "--tbt-slo", "1e9"])
    gates = [settings_from_args(a, layout=None, cost=CostModel()).admit for a in (tight, loose)]  # type: ignore[arg-type]
    if mode != AdmissionMode.BASELINE:
        assert gates == [None, None]
        return
    task, stats = _busy_decode()
    tight_gate, loose_gate = gates
    assert tight_gate is not None and loose_gate is not None
    reason = tight_gate(task, stats, 0)
    assert reason is not None and "over its TBT SLO after prefill" in reason
    assert loose_gate(task, stats, 0) is None


@pytest.mark.parametrize("mode", MODES)
def test_the_simulator_follows_the_same_table(mode):
    sim = Simulator([], SimConfig(admission=mode, prefill=1, decode=1))
    b = admission_mode.behaviour(mode)
    assert sim.placement.tbt_check is b.placement_tbt_check
    assert (sim.decode_gate is not None) is b.decode_gate
    assert type(sim.admission) is ADMISSION_POLICIES[b.admission_policy]


def test_one_set_of_names_everywhere():
    assert admission_modes() == admission_mode.names() == ["baseline", "early", "predict"]
    assert sorted(ADMISSION_POLICIES) == sorted(
        b.admission_policy for b in admission_mode.BEHAVIOUR.values()
    )


# -- perigee up renders it once ---------------------------------------------------------


def _child_mode(child, monkeypatch) -> AdmissionMode:
    """The mode a child of perigee up follows: its argv through its own parser, in the
    environment perigee up gives it."""
    module, *argv = child.argv
    for k, v in child.env.items():
        monkeypatch.setenv(k, v)
    args = importlib.import_module(f"{module}.__main__").parse_args(argv)
    monkeypatch.delenv(ENV, raising=False)
    return args.admission_mode


@pytest.mark.parametrize("mode", MODES)
def test_perigee_up_gives_every_service_the_same_mode(mode, monkeypatch):
    cfg = up_parse(["--engine", "mock", "--admission", mode, "--prefill", "2", "--conductors", "2"])
    children = Stack(cfg).plan()
    following = [c for c in children if c.argv[0] in admission_mode.SERVICES]
    assert {c.argv[0] for c in following} == set(admission_mode.SERVICES)
    assert len(following) == 2 + 1 + 2 + 1  # prefill-0/1, decode-0, conductor-0/1, admission
    for c in following:
        assert c.env[ENV] == mode, c.name
        assert not any(a in ("--admission-mode", "--policy") for a in c.argv), c.name
        assert _child_mode(c, monkeypatch) == mode, c.name
        if c.argv[0] in ("services.prefill", "services.decode"):  # the gate's SLO: the stack's
            assert c.argv[c.argv.index("--tbt-slo") + 1] == str(cfg.tbt_slo), c.name


def test_perigee_up_reads_the_environment_and_refuses_a_contradiction(monkeypatch, capsys):
    monkeypatch.setenv(ENV, "predict")
    assert up_parse(["--engine", "mock"]).admission_mode == AdmissionMode.PREDICT
    assert "contradicts" in _error(capsys, up_parse, ["--engine", "mock", "--admission", "early"])


def test_settle_alone():
    p = argparse.ArgumentParser()
    admission_mode.add_argument(p)
    args = p.parse_args([])
    assert admission_mode.settle(p, args, environ={ENV: " Baseline "}) == AdmissionMode.BASELINE
