"""Two ``perigee up`` on one machine cannot collide (issue 23): a second run on the first
one's port or log directory refuses before it starts or writes anything, naming
``--port`` or ``--log-dir``, and the running stack's files and bus login stay as they
were. The running stack leaves ``<log-dir>/env`` for its user, removed when it stops."""

import asyncio
import hashlib
import json
from pathlib import Path

import nats
import pytest

from perigee.natsd import free_port
from perigee.rundir import RunLock, read_env
from tests.e2e.up_process import UpProcess


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two-stacks")
    port = free_port()
    up = UpProcess(tmp / "first.out", "--port", str(port), "--log-dir", str(tmp / "logs"))
    up.wait_ready()
    yield up, port, tmp / "logs"
    up.stop()


def _fingerprint(log_dir: Path) -> dict[str, str]:
    """What the running stack's users rely on, by content."""
    files = ["nats/credentials.json", "metrics-targets.json", "gateway.log", "env"]
    return {f: hashlib.sha256((log_dir / f).read_bytes()).hexdigest() for f in files}


def _admin_round_trip(url: str) -> None:
    async def go() -> None:
        nc = await nats.connect(url, connect_timeout=5, max_reconnect_attempts=0)
        try:
            sub = await nc.subscribe("demo.echo")
            await nc.publish("demo.echo", b"hi")
            assert (await sub.next_msg(timeout=5)).data == b"hi"
        finally:
            await nc.close()

    asyncio.run(go())


def test_the_env_file_names_the_running_stack(first):
    up, port, logs = first
    env = read_env(logs / "env")
    assert env["PERIGEE_URL"] == f"http://127.0.0.1:{port}"
    assert env["PERIGEE_LOG_DIR"] == str(logs)
    assert env["PERIGEE_MODEL"] == "tiny-llama"
    creds = json.loads((logs / "nats" / "credentials.json").read_text())
    assert env["PERIGEE_NATS_URL"].startswith(f"nats://perigee:{creds['users']['perigee']}@")
    assert f"source {logs}/env" in up.output()
    assert (logs / "env").stat().st_mode & 0o077 == 0  # it holds the admin password
    _admin_round_trip(env["PERIGEE_NATS_URL"])


def test_same_port_is_refused_at_once(first, tmp_path):
    up, port, logs = first
    before = _fingerprint(logs)
    second = UpProcess(tmp_path / "second.out", "--port", str(port), "--log-dir", str(tmp_path))
    rc = second.wait_exit()
    second.stop()
    out = second.output()
    assert rc == 1, out
    assert f"port {port}" in out and "--port" in out, out
    assert "Traceback" not in out, out
    assert "starting" in out and "ready at" not in out, out
    # It started nothing and wrote nothing but its lock (released).
    assert sorted(p.name for p in tmp_path.iterdir()) == ["perigee.lock", "second.out"]
    assert _fingerprint(logs) == before


def test_same_log_dir_is_refused_and_the_stack_is_untouched(first, tmp_path):
    up, port, logs = first
    before = _fingerprint(logs)
    second = UpProcess(tmp_path / "second.out", "--port", str(free_port()), "--log-dir", str(logs))
    rc = second.wait_exit()
    second.stop()
    out = second.output()
    assert rc == 1, out
    assert "--log-dir" in out and str(logs) in out, out
    assert f"pid {up.proc.pid}" in out, out  # who holds it
    assert "Traceback" not in out, out
    assert _fingerprint(logs) == before
    # The running stack's admin login still works (it was overwritten before: issue 23).
    _admin_round_trip(read_env(logs / "env")["PERIGEE_NATS_URL"])


def test_a_stopped_run_leaves_its_log_dir_free(tmp_path):
    logs = tmp_path / "logs"
    up = UpProcess(tmp_path / "up.out", "--port", str(free_port()), "--log-dir", str(logs))
    try:
        up.wait_ready()
        assert (logs / "env").exists()
    finally:
        rc = up.stop()
    assert rc == 0, up.output()
    assert not (logs / "env").exists()  # it named a bus that is gone
    RunLock(logs).acquire().release()  # free for the next run
