"""A clean stop: ``perigee up`` (a real subprocess, real nats-server, the mock engine)
stopped by a terminal's Ctrl-C (SIGINT to its whole process group, sent with
``os.killpg`` exactly as a terminal does) or by SIGTERM, during start-up and while it
serves, exits 0 without a traceback and leaves no process behind; a SIGKILLed one leaves
no orphans. And a service exits 0 on SIGTERM whatever its bus is doing.

Every wait is a poll for an observable condition with a generous deadline; how fast the
stack stops is not asserted (``perigee up`` prints it: "stopped in X s")."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from perigee.natsd import NatsServer, free_port

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 60.0


def _perigee() -> list[str]:
    script = Path(sys.executable).parent / "perigee"
    return [str(script)] if script.exists() else [sys.executable, "-m", "perigee.cli"]


class Up:
    """``perigee up --engine mock`` in a session of its own, as a shell runs a job."""

    def __init__(self, tmp_path: Path) -> None:
        self.port = free_port()
        self.logs = tmp_path / "logs"
        self.out_path = tmp_path / "up.out"
        self.known: list[psutil.Process] = []  # its descendants, killed if a test fails
        self._out = open(self.out_path, "wb")
        self.proc = subprocess.Popen(
            [
                *_perigee(),
                "up",
                "--engine",
                "mock",
                "--speedup",
                "100",
                "--port",
                str(self.port),
                "--log-dir",
                str(self.logs),
            ],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=self._out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def descendants(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def service_logs(self) -> dict[str, str]:
        return {p.stem: p.read_text(errors="replace") for p in self.logs.glob("*.log")}

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def complete(self) -> dict:
        body = json.dumps({"model": "tiny-llama", "prompt": "Hello there", "max_tokens": 4})
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions",
            data=body.encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200
            return json.loads(r.read())

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"perigee up still running {DEADLINE_S:g} s after the signal:\n"
                f"{self.output()[-3000:]}"
            )

    def close(self) -> None:
        for p in [self.proc, *_alive(self.known)]:
            try:
                p.kill()
            except (OSError, psutil.NoSuchProcess):
                pass
        self._out.close()


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def _wait_for(cond, what: str, deadline_s: float = DEADLINE_S) -> None:
    end = time.monotonic() + deadline_s
    while not cond():
        if time.monotonic() > end:
            pytest.fail(f"not within {deadline_s:g} s: {what}")
        time.sleep(0.02)


def _whole_stack(up: Up) -> list[psutil.Process]:
    """nats-server and the seven services of a 1P+1D stack, once all are spawned."""
    procs: list[psutil.Process] = []

    def spawned() -> bool:
        nonlocal procs
        procs = up.descendants()
        return len(procs) >= 8

    _wait_for(spawned, "perigee up spawned nats-server and seven services")
    up.known = procs
    assert any(p.name() == "nats-server" for p in procs)
    return procs


def _more(up: Up, procs: list[psutil.Process]) -> list[psutil.Process]:
    """``procs`` and what the services started since (e.g. the stores' shared-memory
    resource trackers): grandchildren must go too."""
    pids = {p.pid for p in procs}
    more = procs + [p for p in up.descendants() if p.pid not in pids]
    up.known = more
    return more


@pytest.fixture
def up(tmp_path):
    u = Up(tmp_path)
    yield u
    u.close()


def _assert_clean(up: Up, rc: int, procs: list[psutil.Process]) -> None:
    out = up.output()
    assert rc == 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    _wait_for(lambda: not _alive(procs), "every child of perigee up gone")
    for name, text in up.service_logs().items():
        assert "Traceback" not in text, f"{name}.log:\n{text[-3000:]}"


def test_ctrl_c_during_start_up_stops_everything(up):
    procs = _whole_stack(up)
    # The stores log first; the workers are still looking for them, nothing is ready.
    _wait_for(
        lambda: any('"store_started"' in t for t in up.service_logs().values()), "a store started"
    )
    os.killpg(up.proc.pid, signal.SIGINT)
    rc = up.wait()
    _assert_clean(up, rc, procs)
    out = up.output()
    assert "ready at" not in out, out
    assert "stopped during start-up" in out, out


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_stop_while_serving_drains_every_service(up, how):
    procs = _whole_stack(up)
    _wait_for(up.ready, "/ready answers 200")
    # The gateway's /ready can be 200 a moment before perigee up has seen it.
    _wait_for(lambda: "perigee: ready at" in up.output(), "perigee up says it is ready")
    assert up.complete()["choices"][0]["text"] is not None
    procs = _more(up, procs)
    if how == "ctrl-c":
        os.killpg(up.proc.pid, signal.SIGINT)
    else:
        os.kill(up.proc.pid, signal.SIGTERM)
    rc = up.wait()
    _assert_clean(up, rc, procs)
    assert "perigee: stopped in" in up.output()
    # Each service took the signal and stopped itself, nats-server still up behind it.
    for name, text in up.service_logs().items():
        assert '"stop_requested"' in text, f"{name}.log:\n{text[-2000:]}"
        assert '"stop_forced"' not in text, f"{name}.log:\n{text[-2000:]}"
        assert "nats_error" not in text, f"{name}.log:\n{text[-2000:]}"


def test_sigkilled_perigee_up_leaves_no_orphans(up):
    procs = _whole_stack(up)
    _wait_for(lambda: "perigee: ready at" in up.output(), "perigee up says it is ready")
    procs = _more(up, procs)
    os.kill(up.proc.pid, signal.SIGKILL)
    assert up.proc.wait(timeout=DEADLINE_S) == -signal.SIGKILL
    _wait_for(lambda: not _alive(procs), "every child of a SIGKILLed perigee up gone")


# -- one service, its bus in a bad state ----------------------------------------------


def _service(tmp_path: Path, module: str, *args: str) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / f"{module}.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    return proc, log


def _stopped_by_sigterm(proc: subprocess.Popen, log: Path) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"still running {DEADLINE_S:g} s after SIGTERM:\n{log.read_text()[-3000:]}")
    text = log.read_text(errors="replace")
    assert rc == 0, text[-3000:]
    assert "Traceback" not in text, text[-3000:]


def test_worker_waiting_for_its_store_exits_on_sigterm(tmp_path):
    """No store ever answers, and the worker would wait far longer than the deadline."""
    with NatsServer() as nats:
        proc, log = _service(
            tmp_path,
            "services.prefill",
            "--nats",
            nats.url,
            "--engine",
            "mock",
            "--store-timeout",
            "600",
        )
        try:
            port = nats.port

            def on_bus() -> bool:
                conns = psutil.Process(proc.pid).net_connections(kind="tcp")
                return any(
                    c.raddr and c.raddr.port == port and c.status == "ESTABLISHED" for c in conns
                )

            _wait_for(on_bus, "the worker connected to NATS")
            _stopped_by_sigterm(proc, log)
        finally:
            if proc.poll() is None:
                proc.kill()


def test_service_on_a_dead_bus_exits_on_sigterm(tmp_path):
    """Nobody listens at its NATS URL: the connection retries forever."""
    proc, log = _service(
        tmp_path, "services.admission", "--nats", f"nats://127.0.0.1:{free_port()}"
    )
    try:
        _wait_for(
            lambda: "nats_error" in log.read_text(errors="replace"),
            "the admission service failed to reach NATS",
        )
        _stopped_by_sigterm(proc, log)
    finally:
        if proc.poll() is None:
            proc.kill()
