"""The local stack as a set of child processes: what ``perigee up`` runs and what the
end-to-end tests and benchmarks start, through the same code.

Topology: every prefill and every decode instance is a node of its own with one
store process (as in the paper's deployment, one instance per 8-GPU node), so KV
really moves store to store over TCP. ``nats-server`` is started too unless a URL
is given.

Every child runs in a session of its own, so a terminal's Ctrl-C reaches only the
process that owns the stack, and dies with that process (:mod:`perigee.procs`).
:meth:`Stack.stop` stops them in reverse start order, one tier at a time: the gateway
first (it stops taking requests and lets those in flight finish), then the control
plane, the workers, the stores, and nats-server last, so each tier drains through
what is still running.
"""

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import nats

from bus_schemas import subjects
from perigee import deploy_spec, gpus, natsauth
from perigee.natsd import NatsCluster, NatsServer, embedded_procs
from perigee.procs import die_with_parent
from perigee.rundir import RunLock, check_port, write_env
from perigee.stack_config import StackConfig
from perigee.supervise import SupervisedEvent, Supervisor
from services.common import admission_mode, bus, shared_flags
from services.common.model_spec import ModelSpec
from services.transfer.data_auth import ENV as DATA_KEY_ENV
from services.transfer.data_auth import new_key as new_data_key
from tracing.sampler import DEFAULT_RATE as DEFAULT_TRACE_RATE
from tracing.sampler import ENV as TRACE_RATE_ENV

ROOT = Path(__file__).resolve().parents[1]

# Stop order, by the module a child runs: each tier drains through the ones after it.
STOP_TIERS = (
    ("services.gateway",),
    ("services.conductor", "services.admission"),
    ("services.prefill", "services.decode"),
    ("services.store",),
)
# A tier's wait for SIGTERM to work: a service forces its own exit after
# services.common.shutdown.BOUND_S (the gateway after its grace plus 3 s; perigee up
# keeps the default 5 s grace for in-flight requests).
TIER_BOUND_S = {"services.gateway": 8.5}
DEFAULT_TIER_BOUND_S = 5.5
STOP_GRACE_S = 9.0  # the whole stop, nats-server excluded
MIN_TIER_S = 0.5  # a tier reached after that still gets this long


class StartAborted(Exception):
    """:meth:`Stack.start` gave up because its ``abort`` event was set."""


# SLOs for vLLM on a CPU machine with the default model (SmolLM2-135M-Instruct on a
# couple of cores, one OpenMP thread per engine: a 2k-token prompt takes seconds to
# prefill, a decode step ~0.1-0.2 s); measured with perigee bench slo (BENCHMARKS.md):
# what is accepted meets them at p90. Elsewhere the paper's (30 s TTFT, 100 ms TBT, for
# LLaMA3-70B on A800s). README "SLOs".
CPU_TTFT_SLO_S = 15.0
CPU_TBT_SLO_S = 1.0
OVERHEAD_ENV = "PERIGEE_MAX_OVERHEAD_MS"  # the gateway's overhead gate (services.gateway)


def gpu_present() -> bool:
    return gpus.gpu_count() > 0


def default_slos(engine: str) -> tuple[float, float]:
    """(TTFT, TBT) SLOs, s, for a stack of ``engine`` on this machine."""
    if engine == "vllm" and not gpu_present():
        return CPU_TTFT_SLO_S, CPU_TBT_SLO_S
    return StackConfig.ttft_slo, StackConfig.tbt_slo


@dataclass
class Child:
    """One service process of the stack: its name, command line and environment."""

    name: str
    argv: list[str]
    proc: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)


def sampling_env(share: float, rate: float = DEFAULT_TRACE_RATE) -> dict[str, str]:
    """A service's environment for tracing ``share`` of the requests (or, with share
    1.0, at most ``rate`` new traces a second at each root, 0: every request): the
    sampler decides at a trace's root (the gateway, for a request) and every service
    follows the parent's decision, so a traced request is traced whole."""
    if share >= 1.0:
        return {TRACE_RATE_ENV: f"{rate:g}"}
    return {
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": str(share),
    }


class Stack:
    """Starts, watches and stops the services of one local stack."""

    def __init__(self, cfg: StackConfig) -> None:
        # The services run in the repository root: a relative log dir (and spans file)
        # would name another folder for them than for this process and its messages.
        cfg = replace(cfg, log_dir=os.path.abspath(cfg.log_dir))
        self.cfg = cfg
        self.nats: NatsServer | NatsCluster | None = None
        self.nats_url = cfg.nats_url or ""  # one server, with the admin login if any
        self.nats_urls = self.nats_url  # every server (comma list), the same login
        self.children: dict[str, Child] = {}
        self.url = f"http://{cfg.host}:{cfg.port}"
        self.metrics_urls: dict[str, str] = {}  # child name -> its /metrics URL
        log_dir = Path(cfg.log_dir)
        self.spans_file = os.path.abspath(
            cfg.extra_env.get("PERIGEE_SPANS_FILE")
            or os.environ.get("PERIGEE_SPANS_FILE")
            or str(log_dir / "spans.jsonl")
        )
        self.metrics_targets_file = log_dir / "metrics-targets.json"
        # The data plane's key for this run (services.transfer.data_auth), like the NATS passwords:
        # every store and worker gets it; a restarted service gets the same one.
        self.data_key = os.environ.get(DATA_KEY_ENV) or new_data_key()
        # Held from before anything is written into log_dir until stop() (perigee.rundir).
        self.lock = RunLock(log_dir)
        self.env_file: Path | None = None  # <log_dir>/env once ready
        self._abort: threading.Event | None = None
        self.supervisor: Supervisor | None = None
        # What the supervisor did (perigee up prints it); the default logs nothing.
        self.on_supervised: Callable[[SupervisedEvent], None] = lambda e: None

    # -- topology -----------------------------------------------------------------
    def _user_env(self) -> dict[str, str]:
        """What the user set: the environment, then the config's ``extra_env``."""
        return {**os.environ, **self.cfg.extra_env}

    def _engine_env(self, engines: int, cards: int) -> dict[str, str]:
        """vLLM on CPU: each engine gets its share of the cores as OpenMP threads. Left
        at every core each, two engines on two cores oversubscribe them and spin against
        each other (measured: decode TBT p90 0.97 s shared, 0.11 s with one thread each;
        BENCHMARKS.md, bench slo). An OMP_NUM_THREADS the user set wins."""
        if self.cfg.engine != "vllm" or "OMP_NUM_THREADS" in self._user_env():
            return {}
        if cards:
            return {}
        return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // max(1, engines)))}

    def _gate_env(self, cards: int) -> dict[str, str]:
        """vLLM on CPU: the gateway's overhead gate off (``PERIGEE_MAX_OVERHEAD_MS`` 0,
        services.gateway.lateness), unless the user set it. Those engines compute on the
        cores the control plane runs on, so a request's control-plane overhead there is
        mostly the engines' hold on the CPU, not a backlog that turning requests away
        answers: at 20 ms the gate turned 10 of 80 requests of a trace replay away that
        admission alone would have served, and cut the goodput by a quarter
        (BENCHMARKS.md, session 23). The mock engine and GPU engines leave the CPU to
        the control plane: the gateway's default (on) stands."""
        if self.cfg.engine != "vllm" or cards or OVERHEAD_ENV in self._user_env():
            return {}
        return {OVERHEAD_ENV: "0"}

    def plan(self) -> list[Child]:
        """The children, in start order: their command lines from perigee.deploy_spec
        (the one source compose.yaml and deploy/k8s are rendered from too), their
        environment from here."""
        c = self.cfg
        block_bytes = ModelSpec.from_dir(c.model_dir).block_bytes(c.block_size)
        services = deploy_spec.local(c, self.nats_url, block_bytes)
        found = gpus.gpu_count() if c.engine == "vllm" else 0  # nvidia-smi, once
        engine_env = self._engine_env(c.prefill + c.decode, found)
        slots = self._gpu_slots(c.prefill + c.decode, found)
        cards = iter(slots)
        gate_env = self._gate_env(len(slots))
        out = []
        for name, svc in services:
            env = dict(engine_env) if isinstance(svc, deploy_spec.WorkerCmd) else {}
            if svc.module == "services.gateway":
                env.update(gate_env)
            argv = svc.argv()
            card = next(cards, None) if isinstance(svc, deploy_spec.WorkerCmd) else None
            if card is not None:
                env.update(card.env())
                argv += card.args()
            if svc.module in admission_mode.SERVICES:  # one setting for all who follow it
                env[admission_mode.ENV] = str(c.admission_mode)
            out.append(Child(name, argv, env=env))
        return out

    def _gpu_slots(self, engines: int, found: int) -> list[gpus.GpuSlot]:
        """vLLM on GPUs: each engine's card and memory share (perigee.gpus); the cards
        are those CUDA_VISIBLE_DEVICES names where the user set it, else the ``found``."""
        if self.cfg.engine != "vllm":
            return []
        visible = self._user_env().get("CUDA_VISIBLE_DEVICES")
        cards = [d for d in visible.split(",") if d] if visible is not None else None
        n = len(cards) if cards is not None else found
        if n == 0:
            return []
        slots = gpus.spread(engines, n, self.cfg.gpu_memory_utilization or gpus.TOTAL_SHARE)
        if cards is None:
            return slots
        return [gpus.GpuSlot(int(cards[s.device]), s.share) for s in slots]

    def observability(self, children: list[Child]) -> list[Child]:
        """Give each service a free /metrics port (the gateway serves it on its own) and
        the gateway its API key; writes Prometheus file_sd targets to
        ``<log_dir>/metrics-targets.json``."""
        from perigee.natsd import free_port

        c = self.cfg
        targets = []
        for child in children:
            kind = child.argv[0].removeprefix("services.")
            if c.durable_intake and kind in ("gateway", "admission", "conductor"):
                child.argv.append("--durable-intake")
            child.argv += c.service_args.get(kind, [])
            if child.name == "gateway":
                if c.api_key:
                    child.env["PERIGEE_API_KEY"] = c.api_key
                addr = f"{c.host}:{c.port}"
            elif c.metrics:
                port = free_port()
                child.argv += shared_flags.Metrics(port, c.host).argv()
                addr = f"{c.host}:{port}"
            else:
                continue
            self.metrics_urls[child.name] = f"http://{addr}/metrics"
            role = child.argv[0].removeprefix("services.")
            targets.append(
                {
                    "targets": [addr],
                    "labels": {"job": "perigee", "service": child.name, "role": role},
                }
            )
        if c.metrics:
            self.metrics_targets_file.parent.mkdir(parents=True, exist_ok=True)
            self.metrics_targets_file.write_text(json.dumps(targets, indent=2) + "\n")
        return children

    # -- lifecycle ----------------------------------------------------------------
    def _spawn(self, child: Child) -> None:
        log_dir = Path(self.cfg.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        root = Path(self.cfg.code_root).resolve() if self.cfg.code_root else ROOT
        env = {**os.environ, **self.cfg.extra_env, **child.env, "PYTHONPATH": str(root)}
        env.setdefault(DATA_KEY_ENV, self.data_key)
        env.setdefault("OTEL_SERVICE_NAME", child.name)
        env.setdefault("PERIGEE_SPANS_FILE", self.spans_file)
        env.setdefault("OTEL_BSP_SCHEDULE_DELAY", "500")  # ms: spans reach the file promptly
        env.update(sampling_env(self.cfg.trace_sample, self.cfg.trace_rate))
        with open(log_dir / f"{child.name}.log", "ab") as log:
            child.proc = subprocess.Popen(
                [sys.executable, "-m", *child.argv],
                cwd=root,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent(),
            )
        self.children[child.name] = child

    def start(self, timeout: float | None = None, abort: threading.Event | None = None) -> "Stack":
        """Start everything; ``timeout`` (default 60 s, 300 s for vLLM engines, which
        import and warm up for ~20 s each on a small CPU machine) bounds the wait.
        Setting ``abort`` (from a signal handler) stops what was started and raises
        :class:`StartAborted` within about half a second."""
        if timeout is None:
            timeout = 300.0 if self.cfg.engine == "vllm" else 60.0
        self._abort = abort
        # Before anything starts or is written: another live run's log dir, a busy port.
        self.lock.acquire(self.url)
        try:
            check_port(self.cfg.host, self.cfg.port)
            for child in self._with_bus():
                self._check_alive()
                self._spawn(child)
            asyncio.run(self._wait_ready(timeout))
            self.env_file = self.write_env()
        except BaseException:
            self.stop()
            raise
        if self.cfg.supervise:
            self.supervise()
        return self

    def write_env(self) -> Path:
        """``<log_dir>/env``: ``source`` it for this stack's addresses, the bus's with the
        admin login (README "Talking to the bus directly")."""
        values = {
            "PERIGEE_URL": self.url,
            "PERIGEE_MODEL": self.cfg.served_model_name or Path(self.cfg.model_dir).name,
            "PERIGEE_NATS_URL": self.nats_url,
            "PERIGEE_NATS_SERVERS": self.nats_urls,
            "PERIGEE_LOG_DIR": self.cfg.log_dir,
        }
        comment = (
            f"The perigee stack of pid {os.getpid()} (removed when it stops): "
            f"source {self.cfg.log_dir}/env\nPERIGEE_NATS_URL logs in as the bus's admin user."
        )
        return write_env(self.cfg.log_dir, values, comment)

    def supervise(self) -> None:
        """From now on a service that dies is restarted (:mod:`perigee.supervise`)."""
        self.supervisor = Supervisor(
            self._supervised,
            self._respawn,
            self.cfg.restart_policy,
            on_event=lambda e: self.on_supervised(e),
        )
        self.supervisor.start()

    def nats_servers(self) -> dict[str, NatsServer]:
        """The nats-servers this stack started, by the name the supervisor uses."""
        if isinstance(self.nats, NatsCluster):
            return {f"nats-{srv.name}": srv for srv in self.nats.servers}
        return {"nats-server": self.nats} if self.nats is not None else {}

    def _supervised(self) -> dict:
        procs = {n: c.proc for n, c in list(self.children.items())}
        procs.update({n: srv.proc for n, srv in self.nats_servers().items()})
        return procs

    def _respawn(self, name: str) -> None:
        if name in self.children:
            self._spawn(self.children[name])
        else:  # the same ports, config and JetStream store: clients reconnect to it
            self.nats_servers()[name].spawn()

    @property
    def restarts(self) -> dict[str, int]:
        """Restarts so far by service name (empty when not supervised)."""
        return dict(self.supervisor.restarts) if self.supervisor else {}

    def _with_bus(self) -> list[Child]:
        """Plan the children and start their nats-server (or cluster) unless given a URL:
        with auth, each child gets its own user (:mod:`perigee.natsauth`) in
        ``NATS_USER``/``NATS_PASSWORD``, the admin login goes into ``nats_url`` (what the
        readiness checks, tools and tests use), every login into
        ``<log_dir>/nats/credentials.json`` (mode 0600) beside the servers' logs."""
        c = self.cfg
        if self.nats_url:
            return self.observability(self.plan())
        log_dir = Path(c.log_dir) / "nats"  # not beside the services' logs: no service's
        log_dir.mkdir(parents=True, exist_ok=True)
        self.nats = self.new_nats(log_dir)
        self.nats_url = self.nats.url  # the services' --nats: every server, no login
        children = self.plan()
        servers = self.nats.url.split(",")
        for child in children:
            child.env["PERIGEE_JS_REPLICAS"] = str(min(3, c.nats_cluster))
        if c.nats_auth:
            users = natsauth.users(
                natsauth.Deployment(
                    [natsauth.member(ch.name, ch.argv) for ch in children], c.switchable
                )
            )
            for srv in getattr(self.nats, "servers", [self.nats]):
                srv.auth = natsauth.render(users)
            login = {u.name: u.password for u in users}
            for child in children:
                child.env.update(NATS_USER=child.name, NATS_PASSWORD=login[child.name])
            creds = log_dir / "credentials.json"
            fd = os.open(creds, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({"servers": servers, "users": login}, f, indent=2)
            admin = f"{natsauth.ADMIN}:{login[natsauth.ADMIN]}@"
            servers = [u.replace("nats://", "nats://" + admin, 1) for u in servers]
        self.nats.start()  # before the metrics ports are drawn: they cannot take its own
        self.nats_url, self.nats_urls = servers[0], ",".join(servers)
        return self.observability(children)

    def new_nats(self, log_dir: Path) -> NatsServer | NatsCluster:
        """The bus this stack starts (not yet started), its logs in ``log_dir``."""
        c = self.cfg
        procs = embedded_procs() if c.nats_procs is None else c.nats_procs or None
        if c.nats_cluster > 1:
            return NatsCluster(
                c.nats_cluster, max_payload=c.nats_max_payload, log_dir=str(log_dir), procs=procs
            )
        return NatsServer(
            max_payload=c.nats_max_payload,
            log_file=str(log_dir / "nats-server.log"),
            procs=procs,
        )

    async def _wait_ready(self, timeout: float) -> None:
        """Ready when every worker has reported load, admission and the conductors
        answer, and the gateway is ready."""
        want = {f"prefill-{i}" for i in range(self.cfg.prefill)}
        want |= {f"decode-{i}" for i in range(self.cfg.decode)}
        seen: set[str] = set()
        ready = asyncio.Event()

        async def on_load(m) -> None:
            seen.add(m.subject.rsplit(".", 1)[-1])
            if want <= seen:
                ready.set()

        nc = await nats.connect(self.nats_url)
        try:
            await nc.subscribe(subjects.LOAD_ALL, cb=on_load)
            deadline = time.monotonic() + timeout
            if self.cfg.nats_cluster > 1 and self.nats is not None:
                await self._jetstream_ready(nc, deadline)
            while not ready.is_set():
                self._check_alive()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"workers not ready: missing {sorted(want - seen)}")
                try:
                    await asyncio.wait_for(ready.wait(), 0.5)
                except TimeoutError:
                    pass
            # Admission and every conductor answer a probe: a reply proves their
            # subscriptions are live before the first request (a conductor's own events
            # subject is the last it subscribes, after its share of the intake queue).
            conductors = [
                subjects.conductor_events(f"conductor-{i}") for i in range(self.cfg.conductors)
            ]
            for subject in (subjects.REQUESTS, subjects.SCHEDULE, *conductors):
                while True:
                    self._check_alive()
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"nobody serves {subject}")
                    try:
                        await nc.request(
                            subject, b"", timeout=0.5, headers={bus.PROBE_HEADER: "ready"}
                        )
                        break
                    except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                        await asyncio.sleep(0.05)
            # The gateway ready: it heard an admission and a conductor beat and the
            # workers report (what its /v1/models waits for, as clients poll it).
            while not await asyncio.to_thread(self._gateway_ready):
                self._check_alive()
                if time.monotonic() > deadline:
                    raise TimeoutError("the gateway did not become ready (GET /ready)")
                await asyncio.sleep(0.1)
        finally:
            await nc.close()

    async def _jetstream_ready(self, nc, deadline: float) -> None:
        """A clustered JetStream answers once its servers have elected a meta leader."""
        while True:
            self._check_alive()
            try:
                r = await nc.request("$JS.API.INFO", b"", timeout=0.5)
                if b'"error"' not in r.data:
                    return
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the NATS cluster elected no JetStream leader")
            await asyncio.sleep(0.1)

    def _gateway_ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/ready", timeout=1) as r:
                return r.status == 200
        except OSError:  # HTTPError (503) included
            return False

    def exited(self) -> list[Child]:
        return [c for c in self.children.values() if c.proc and c.proc.poll() is not None]

    def _check_alive(self) -> None:
        if self._abort is not None and self._abort.is_set():
            raise StartAborted("stopped during start-up")
        for c in self.exited():
            log = Path(self.cfg.log_dir) / f"{c.name}.log"
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            raise RuntimeError(f"{c.name} exited with {c.proc.returncode}:\n{tail}")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Kill one service abruptly (fault-injection in tests)."""
        proc = self.children[name].proc
        if proc and proc.poll() is None:
            proc.send_signal(sig)
            proc.wait(timeout=10)

    def restart(self, name: str) -> None:
        """Start a service killed with :meth:`kill` again (fault-injection in tests)."""
        self._respawn(name)

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """SIGTERM tier by tier (:data:`STOP_TIERS`), each waited on for its bound,
        ``grace`` in all; what outlives its tier's wait gets SIGKILL. nats-server last."""
        if self.supervisor is not None:
            self.supervisor.hold()  # nothing restarted while stopping
        deadline = time.monotonic() + grace
        tiers = [[c for c in self.children.values() if c.argv[0] in mods] for mods in STOP_TIERS]
        tiered = {c.name for tier in tiers for c in tier}
        tiers.append([c for c in self.children.values() if c.name not in tiered])
        for tier in tiers:
            procs = [c.proc for c in tier if c.proc and c.proc.poll() is None]
            for p in procs:
                p.send_signal(signal.SIGTERM)
            now = time.monotonic()
            bound = max(
                (TIER_BOUND_S.get(c.argv[0], DEFAULT_TIER_BOUND_S) for c in tier), default=0.0
            )
            until = max(min(now + bound, deadline), now + MIN_TIER_S)
            for p in procs:
                try:
                    p.wait(timeout=max(0.0, until - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        if self.nats is not None:
            self.nats.stop()
            self.nats = None
        if self.supervisor is not None:  # its children are gone: its thread may end
            self.supervisor.quit()
            self.supervisor = None
        if self.env_file is not None:  # it names a bus that is gone
            self.env_file.unlink(missing_ok=True)
            self.env_file = None
        self.lock.release()

    def kill_all(self) -> None:
        """SIGKILL every child and nats-server now (a second Ctrl-C); safe in a signal
        handler: it only sends signals."""
        procs = [c.proc for c in self.children.values() if c.proc]
        if self.nats is not None:
            procs += [s.proc for s in getattr(self.nats, "servers", [self.nats]) if s.proc]
        for p in procs:
            if p.returncode is None:  # not reaped: the pid is still this child's
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except OSError:
                    pass

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
