"""The shared flag groups: each renders what its parser reads back, and every child of
``perigee up`` parses, with its own parser, the bus, SLOs, liveness and intake that
the stack's configuration says."""

import argparse
import dataclasses
import importlib

import pytest

from perigee.stack import Stack
from perigee.up import parse as up_parse
from services.common.shared_flags import Bus, DeadAfter, Intake, Metrics, Slos, joined


def _parser(*groups) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    for g in groups:
        g.add(p)
    return p


def test_each_group_renders_what_it_reads_back():
    bus = Bus("nats://u:p@10.0.0.1:4333", "DEBUG")
    assert Bus.of(_parser(Bus).parse_args(bus.argv())) == bus
    intake = Intake(durable=False, ack_wait_s=7.5, patience_s=0.0)
    assert Intake.of(_parser(Intake).parse_args(intake.argv())) == intake
    ns = _parser(Slos, DeadAfter).parse_args([*Slos(3.0, 0.07).argv(), *DeadAfter(4.5).argv()])
    assert (ns.ttft_slo, ns.tbt_slo, ns.dead_after) == (3.0, 0.07, 4.5)
    assert Slos(3.0, 0.07).argv(ttft=False) == ["--tbt-slo", "0.07"]
    metrics = Metrics(9400, "0.0.0.0")
    assert Metrics.of(_parser(Metrics).parse_args(metrics.argv())) == metrics
    # the defaults are the parsers' defaults
    assert Bus.of(_parser(Bus).parse_args([])) == Bus()
    assert Intake.of(_parser(Intake).parse_args([])) == Intake()
    assert Metrics.of(_parser(Metrics).parse_args([])) == Metrics()


def test_a_field_left_none_is_not_passed_and_a_manifest_may_name_a_variable():
    assert Bus("nats://n:4222", None).argv() == ["--nats", "nats://n:4222"]
    assert Slos(None, 0.5).argv() == ["--tbt-slo", "0.5"]
    assert joined(Slos("$(TTFT_SLO)", "$(TBT_SLO)").args()) == [
        "--ttft-slo=$(TTFT_SLO)",
        "--tbt-slo=$(TBT_SLO)",
    ]
    assert joined(Intake(durable=False).args())[0] == "--no-durable-intake"


def _parsed(child, monkeypatch) -> argparse.Namespace:
    module, *argv = child.argv
    for k, v in child.env.items():
        monkeypatch.setenv(k, v)
    name = module if module.startswith("services.worker") else f"{module}.__main__"
    return importlib.import_module(name).parse_args(argv)


@pytest.mark.parametrize("log_level", ["INFO", "DEBUG"])
def test_every_child_of_perigee_up_parses_the_stacks_flags(log_level, monkeypatch):
    cfg = up_parse(
        [
            "--engine",
            "mock",
            "--log-level",
            log_level,
            "--ttft-slo",
            "7.5",
            "--tbt-slo",
            "0.125",
        ]
    )
    stack = Stack(dataclasses.replace(cfg, dead_after=3.5))
    stack.nats_url = "nats://admin:pw@127.0.0.1:4999"
    children = stack.plan()
    assert {c.argv[0] for c in children} >= {
        "services.store",
        "services.prefill",
        "services.decode",
        "services.admission",
        "services.conductor",
        "services.gateway",
    }
    for c in children:
        ns = _parsed(c, monkeypatch)
        assert Bus.of(ns) == Bus(stack.nats_url, log_level), c.name
        if c.argv[0] in ("services.admission", "services.conductor", "services.gateway"):
            assert (ns.ttft_slo, ns.tbt_slo, ns.dead_after) == (7.5, 0.125, 3.5), c.name
        if c.argv[0] in ("services.prefill", "services.decode"):
            assert ns.tbt_slo == 0.125, c.name
        if c.argv[0] in ("services.admission", "services.conductor"):
            assert Intake.of(ns) == Intake(), c.name
