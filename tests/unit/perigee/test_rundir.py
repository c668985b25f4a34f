"""perigee.rundir: the log-dir lock, the port check, the env file; and the stack's paths
are absolute whatever the caller's working directory (the services run in the repo)."""

import os
import socket
import subprocess
import sys

import pytest

from perigee.rundir import RunCollision, RunLock, check_port, port_in_use, read_env, write_env
from perigee.stack import Stack, StackConfig


def test_a_held_lock_refuses_another_holder_and_names_it(tmp_path):
    first = RunLock(tmp_path).acquire("http://127.0.0.1:8000")
    with pytest.raises(RunCollision) as e:
        RunLock(tmp_path).acquire()
    msg = str(e.value)
    assert f"pid {os.getpid()}" in msg and "http://127.0.0.1:8000" in msg
    assert "--log-dir" in msg and str(tmp_path) in msg
    first.release()
    RunLock(tmp_path).acquire().release()


def test_a_dead_holder_leaves_no_lock(tmp_path):
    code = (
        f"from perigee.rundir import RunLock; RunLock({str(tmp_path)!r}).acquire(); print('held')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "held"  # the process exited holding it
    RunLock(tmp_path).acquire().release()


def test_a_listening_port_is_in_use():
    assert not port_in_use("127.0.0.1", 0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.listen()
        assert port_in_use("127.0.0.1", port)
        with pytest.raises(RunCollision, match=f"port {port} .*--port"):
            check_port("127.0.0.1", port)


def test_env_file_round_trips_and_is_private(tmp_path):
    values = {"PERIGEE_NATS_URL": "nats://perigee:p'w$x@127.0.0.1:4222", "PERIGEE_URL": "u"}
    path = write_env(tmp_path, values, "a comment\nsecond line")
    assert read_env(path) == values
    assert path.stat().st_mode & 0o777 == 0o600
    shell = subprocess.run(
        ["bash", "-c", f'source {path} && printf %s "$PERIGEE_NATS_URL"'],
        capture_output=True,
        text=True,
        check=True,
    )
    assert shell.stdout == values["PERIGEE_NATS_URL"]


def test_stack_paths_are_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PERIGEE_SPANS_FILE", raising=False)
    s = Stack(StackConfig(log_dir="rel/logs"))
    assert s.cfg.log_dir == str(tmp_path / "rel" / "logs")
    assert s.spans_file == str(tmp_path / "rel" / "logs" / "spans.jsonl")
    assert s.lock.path == tmp_path / "rel" / "logs" / "perigee.lock"
