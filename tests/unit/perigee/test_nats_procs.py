"""The embedded nats-server's GOMAXPROCS: a quarter of the cores by default, as asked
with --nats-procs, and never over an operator's own GOMAXPROCS."""

from pathlib import Path

from perigee import up_flags
from perigee.natsd import NatsServer, embedded_procs, server_env
from perigee.up import parse


def test_a_quarter_of_the_cores_at_least_one():
    assert [embedded_procs(c) for c in (1, 2, 4, 7, 8, 16, 64)] == [1, 1, 1, 1, 2, 4, 16]


def test_the_environment_sets_it_unless_the_operator_did(monkeypatch):
    monkeypatch.delenv("GOMAXPROCS", raising=False)
    assert server_env(None) is None and server_env(0) is None
    assert server_env(2)["GOMAXPROCS"] == "2"
    monkeypatch.setenv("GOMAXPROCS", "6")
    assert server_env(2) is None  # inherited: 6


def test_the_server_process_runs_with_it(monkeypatch):
    monkeypatch.delenv("GOMAXPROCS", raising=False)
    with NatsServer(procs=1) as srv:
        environ = Path(f"/proc/{srv.proc.pid}/environ").read_bytes().split(b"\0")
    assert b"GOMAXPROCS=1" in environ


def test_perigee_up_takes_nats_procs():
    assert parse(["--engine", "mock"]).nats_procs is None  # the default: automatic
    assert parse(["--engine", "mock", "--nats-procs", "0"]).nats_procs == 0
    assert "--nats-procs" in {n for g in up_flags.GROUPS.values() for names, _ in g for n in names}
