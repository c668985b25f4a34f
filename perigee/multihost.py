"""Several hosts on one machine: the stack spread over Linux network namespaces.

``python -m perigee.multihost --hosts 3`` (root; ``perigee multihost`` too) builds

    switch namespace:  bridge br0 ── veth ── host 0: eth0 10.77.0.1/24  nats n0, gateway,
                                  │                  admission, conductor, store p0, prefill-0
                                  ├─ veth ── host 1: eth0 10.77.0.2/24  nats n1, store p1, prefill-1
                                  └─ veth ── host 2: eth0 10.77.0.3/24  nats n2, store d0, decode-0

Each host is a network namespace with its own address and a mount namespace with its
own ``/dev/shm`` (a private tmpfs), so the hosts share no memory: a worker attaches its
own host's store arena, and KV moves between hosts only through the stores' transfer
engine (multi-stream TCP, coordinated over ZeroMQ), across the veths. The bridge lives in a namespace of its own, so nothing is
added to the machine's own network. Serving nodes go round-robin over the hosts
(prefill nodes first, then decode), the control plane on host 0. NATS is a cluster
across the hosts (``--nats-cluster``, default one server on each of the first three):
server ``i`` listens on host ``i``'s address, the routes between them cross the veths,
JetStream streams get min(3, n) replicas, and every service is given the whole server
list and its own login, as under ``perigee up --nats-cluster``.

The namespaces exist only while the stack runs; :meth:`Hosts.close` removes all of
them (and every process in them has been stopped by then). Reach the gateway from a
host namespace: ``ip netns exec <host 0> curl http://10.77.0.1:8000/v1/models``.
"""

import argparse
import asyncio
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from perigee.natsd import NatsCluster, NatsServer
from perigee.procs import die_with_parent
from perigee.stack import ROOT, Child, Stack, StackConfig, StartAborted, sampling_env
from services.transfer.data_auth import ENV as DATA_KEY_ENV

SUBNET = "10.77.0"  # /24, assigned only inside the namespaces built here
NETNS_DIR = Path("/run/netns")
CLONE_NEWNET = 0x40000000
T = TypeVar("T")


def unavailable() -> str:
    """Why namespaces cannot be built here ("" when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nsenter", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    return ""


def _sh(*argv: str) -> None:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip() or r.returncode}")


@dataclass(frozen=True)
class Host:
    """One simulated host: its network and mount namespaces and its address."""

    index: int
    netns: str  # ip netns name
    addr: str  # its eth0 address
    mntns: Path  # a bind-mounted mount namespace with a private /dev/shm

    def nats_server_args(self) -> dict:
        """Where a nats-server of the cluster runs on this host (perigee.natsd.NatsServer):
        its own address, the usual ports (each host has a network of its own), started
        through nsenter and probed from a thread inside the namespace."""
        return {
            "host": self.addr,
            "port": 4222,
            "cluster_port": 6222,
            "launcher": self.nsenter(),
            "reach": lambda probe: on_host(self, probe),
        }

    def nsenter(self) -> list[str]:
        """A command prefix that runs what follows on this host."""
        return [
            "nsenter",
            f"--net={NETNS_DIR / self.netns}",
            f"--mount={self.mntns}",
            f"--wd={ROOT}",
            "--",
        ]

    def link_stats(self) -> dict[str, int]:
        """eth0's counters (rx_bytes, tx_bytes, rx_packets...) as the kernel counts them."""
        r = subprocess.run(
            ["ip", "-n", self.netns, "-s", "-j", "link", "show", "dev", "eth0"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
        s = json.loads(r.stdout)[0]["stats64"]
        return {f"rx_{k}": v for k, v in s["rx"].items()} | {
            f"tx_{k}": v for k, v in s["tx"].items()
        }


class Hosts:
    """``n`` hosts on one bridge; :meth:`close` undoes everything :meth:`open` did,
    also after a partial failure."""

    def __init__(self, n: int, shm_size: str = "1g", tag: str | None = None) -> None:
        if n < 1:
            raise ValueError("need at least one host")
        self.n = n
        self.shm_size = shm_size
        self.tag = tag or f"pgmh{uuid.uuid4().hex[:6]}"
        self.switch = f"{self.tag}-sw"
        self.hosts: list[Host] = []
        self._netns: list[str] = []
        self._mounts: list[Path] = []  # unmounted in reverse order
        self._dir: Path | None = None

    def open(self) -> "Hosts":
        try:
            self._open()
        except BaseException:
            self.close()
            raise
        return self

    def _open(self) -> None:
        if why := unavailable():
            raise RuntimeError(why)
        # Mount namespaces persist as bind mounts of their /proc/<pid>/ns/mnt, which
        # must live on a mount that is not shared.
        self._dir = Path(tempfile.mkdtemp(prefix=f"{self.tag}-", dir="/run"))
        _sh("mount", "--bind", str(self._dir), str(self._dir))
        self._mounts.append(self._dir)
        _sh("mount", "--make-private", str(self._dir))
        self._add_netns(self.switch)
        _sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i in range(self.n):
            ns = f"{self.tag}-h{i}"
            self._add_netns(ns)
            port = f"h{i}"  # the switch's end of host i's cable
            _sh(
                "ip",
                "link",
                "add",
                "eth0",
                "netns",
                ns,
                "type",
                "veth",
                "peer",
                "name",
                port,
                "netns",
                self.switch,
            )
            _sh("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
            addr = f"{SUBNET}.{i + 1}"
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            mnt = self._dir / f"h{i}.mnt"
            mnt.touch()
            _sh(
                "unshare",
                f"--mount={mnt}",
                "--propagation",
                "private",
                "mount",
                "-t",
                "tmpfs",
                "-o",
                f"size={self.shm_size},mode=1777",
                f"{self.tag}-shm{i}",
                "/dev/shm",
            )
            self._mounts.append(mnt)
            self.hosts.append(Host(i, ns, addr, mnt))

    def _add_netns(self, name: str) -> None:
        _sh("ip", "netns", "add", name)
        self._netns.append(name)

    def close(self) -> None:
        """Remove every namespace and mount this object made (best effort, each step on
        its own, so one failure leaves nothing else behind)."""
        errors = []
        for ns in reversed(self._netns):  # a veth dies with either of its namespaces
            try:
                _sh("ip", "netns", "del", ns)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                errors.append(str(e))
        self._netns.clear()
        for m in reversed(self._mounts):
            try:
                _sh("umount", str(m))
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                errors.append(str(e))
        self._mounts.clear()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        self.hosts.clear()
        if errors:
            print("perigee multihost: teardown: " + "; ".join(errors), file=sys.stderr)

    def __enter__(self) -> "Hosts":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()


def _setns(path: Path) -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    with open(path) as f:
        if libc.setns(f.fileno(), CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns {path}")


def on_host(host: Host, fn: Callable[[], T]) -> T:
    """``fn()`` in a thread of its own that has joined ``host``'s network namespace
    (and so do the threads it starts): its sockets are that host's. This thread and
    the process's others stay where they are."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            _setns(NETNS_DIR / host.netns)
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            box["error"] = e

    t = threading.Thread(target=run, name=f"on-{host.netns}")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


class MultiHostStack(Stack):
    """:class:`perigee.stack.Stack` with every child run on a host of ``hosts``: the
    same plan and the same command lines, with each service's addresses its host's."""

    def __init__(self, cfg: StackConfig, hosts: Hosts) -> None:
        self.hosts = hosts
        head = hosts.hosts[0]
        cfg.host = head.addr
        super().__init__(cfg)
        self.placement: dict[str, Host] = {}  # child name -> host

    def host_of_node(self, node: str) -> Host:
        """Serving nodes round-robin: p0, p1, ..., d0, d1, ... over hosts 0, 1, 2, ..."""
        nodes = [f"p{i}" for i in range(self.cfg.prefill)] + [
            f"d{i}" for i in range(self.cfg.decode)
        ]
        return self.hosts.hosts[nodes.index(node) % len(self.hosts.hosts)]

    def plan(self) -> list[Child]:
        head = self.hosts.hosts[0]
        out = super().plan()
        for child in out:
            node = _flag(child.argv, "--node")
            host = self.host_of_node(node) if node else head
            self.placement[child.name] = host
            _set_flag(child.argv, "--host", host.addr)
        return out

    def observability(self, children: list[Child]) -> list[Child]:
        children = super().observability(children)
        for child in children:
            host = self.placement[child.name]
            if _flag(child.argv, "--metrics-host"):
                _set_flag(child.argv, "--metrics-host", host.addr)
                port = _flag(child.argv, "--metrics-port")
                self.metrics_urls[child.name] = f"http://{host.addr}:{port}/metrics"
        if self.cfg.metrics:
            targets = [
                {
                    "targets": [url.removeprefix("http://").removesuffix("/metrics")],
                    "labels": {
                        "job": "perigee",
                        "service": name,
                        "host": self.placement[name].netns,
                    },
                }
                for name, url in self.metrics_urls.items()
            ]
            self.metrics_targets_file.write_text(json.dumps(targets, indent=2) + "\n")
        return children

    def _spawn(self, child: Child) -> None:
        log_dir = Path(self.cfg.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.cfg.extra_env, **child.env, "PYTHONPATH": str(ROOT)}
        env.setdefault(DATA_KEY_ENV, self.data_key)
        env.setdefault("OTEL_SERVICE_NAME", child.name)
        env.setdefault("PERIGEE_SPANS_FILE", str(Path(self.spans_file).resolve()))
        env.setdefault("OTEL_BSP_SCHEDULE_DELAY", "500")
        env.update(sampling_env(self.cfg.trace_sample, self.cfg.trace_rate))
        host = self.placement[child.name]
        # nsenter joins the namespaces and execs the service: the pid is the service's,
        # and PR_SET_PDEATHSIG (kept across exec) still ties it to this process.
        with open(log_dir / f"{child.name}.log", "ab") as log:
            child.proc = subprocess.Popen(
                [*host.nsenter(), sys.executable, "-m", *child.argv],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent(),
            )
        self.children[child.name] = child

    def new_nats(self, log_dir: Path) -> NatsServer | NatsCluster:
        n = self.cfg.nats_cluster
        if n > 1:
            return NatsCluster(
                n,
                max_payload=self.cfg.nats_max_payload,
                log_dir=str(log_dir),
                hosts=self.hosts.hosts[:n],
            )
        return NatsServer(  # its cluster_port is unused: no cluster
            max_payload=self.cfg.nats_max_payload,
            log_file=str(log_dir / "nats-server.log"),
            **self.hosts.hosts[0].nats_server_args(),
        )

    def start(
        self, timeout: float | None = None, abort: threading.Event | None = None
    ) -> "MultiHostStack":
        if timeout is None:
            timeout = 300.0 if self.cfg.engine == "vllm" else 60.0
        self._abort = abort
        Path(self.cfg.log_dir).mkdir(parents=True, exist_ok=True)
        try:
            # Children (nats-servers included) are forked from this thread (their
            # PR_SET_PDEATHSIG follows it); the readiness checks talk to the hosts from
            # threads inside their namespaces.
            for child in self._with_bus():
                self._check_alive()
                self._spawn(child)
            on_host(self.hosts.hosts[0], lambda: asyncio.run(self._wait_ready(timeout)))
        except BaseException:
            self.stop()
            raise
        return self


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1] if name in argv else ""


def _set_flag(argv: list[str], name: str, value: str) -> None:
    if name in argv:
        argv[argv.index(name) + 1] = value


def parse(argv: list[str]) -> tuple[argparse.Namespace, StackConfig]:
    p = argparse.ArgumentParser(
        prog="python -m perigee.multihost",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--hosts", type=int, default=3, help="network namespaces (hosts)")
    p.add_argument("--prefill", type=int, default=2, help="prefill instances")
    p.add_argument("--decode", type=int, default=1, help="decode instances")
    p.add_argument(
        "--engine",
        choices=["mock", "vllm"],
        default="mock",
        help="mock (default here: fast, deterministic tokens) or vllm",
    )
    p.add_argument("--model", dest="model_dir", default=None, help="model directory")
    p.add_argument("--speedup", default="1.0", help="mock engine speed-up")
    p.add_argument("--port", type=int, default=8000, help="gateway port on host 0")
    p.add_argument("--shm-size", default="1g", help="each host's /dev/shm (tmpfs size)")
    p.add_argument(
        "--nats-cluster",
        type=int,
        default=None,
        help="nats-servers, one on each of the first N hosts (default: min(3, --hosts))",
    )
    p.add_argument("--log-dir", default=".perigee/logs-multihost")
    a = p.parse_args(argv)
    if a.nats_cluster is None:
        a.nats_cluster = min(3, a.hosts)
    if not 1 <= a.nats_cluster <= a.hosts:
        p.error(f"--nats-cluster {a.nats_cluster}: one server a host, {a.hosts} hosts")
    cfg = StackConfig(
        port=a.port,
        prefill=a.prefill,
        decode=a.decode,
        engine=a.engine,
        speedup=a.speedup,
        log_dir=a.log_dir,
        nats_cluster=a.nats_cluster,
    )
    if a.model_dir:
        cfg.model_dir = a.model_dir
    return a, cfg


def main(argv: list[str] | None = None) -> int:
    a, cfg = parse(list(sys.argv[1:] if argv is None else argv))
    if why := unavailable():
        print(f"perigee multihost: {why}", file=sys.stderr)
        return 1
    stop = threading.Event()

    def on_signal(signum: int, _frame) -> None:
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    with Hosts(a.hosts, shm_size=a.shm_size) as hosts:
        stack = MultiHostStack(cfg, hosts)
        try:
            stack.start(abort=stop)
        except StartAborted:
            return 0
        except (RuntimeError, TimeoutError) as e:
            print(f"perigee multihost: start failed: {e}", file=sys.stderr, flush=True)
            return 1
        try:
            head = hosts.hosts[0].netns
            for name, host in stack.placement.items():
                print(f"  {host.netns} {host.addr:<11} {name}", flush=True)
            print(
                f"perigee multihost: ready at {stack.url} (NATS {stack.nats.url}, logins "
                f"in {cfg.log_dir}/nats/credentials.json)\n"
                f"  ip netns exec {head} curl {stack.url}/v1/completions "
                "-H 'Content-Type: application/json' "
                '-d \'{"prompt": "Hello", "max_tokens": 8}\'\n'
                f"  ip -n {hosts.hosts[-1].netns} -s link show eth0   # bytes over a veth\n"
                "perigee multihost: Ctrl-C stops everything and removes the namespaces",
                flush=True,
            )
            while not stop.wait(0.5):
                pass
        finally:
            stack.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
