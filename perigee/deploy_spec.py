"""Every perigee service's command line, written once, for the three ways the house is
deployed: ``perigee up`` (:func:`local`, which :meth:`perigee.stack.Stack.plan` starts),
compose.yaml (:func:`compose`) and the Kubernetes manifests under deploy/k8s
(:func:`k8s`).

Each role is a dataclass whose fields are its flags, in the order they are written:
a field named ``model_dir`` is ``--model-dir``, a value None or False is not passed
(the service's default holds), True is a switch, a tuple repeats the flag, and a flag
group of services.common.shared_flags (bus, SLOs, liveness, metrics) adds its own. A
target fills the fields with what it has: perigee up its configuration, compose its
literals, Kubernetes ``$(VAR)`` references to the perigee-config ConfigMap and the
pod's downward API. ``perigee render compose|k8s`` (perigee.render) writes the
manifests' command lines from here; tests/unit/perigee/test_render.py fails when a
checked-in one differs."""

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from bus_schemas.roles import Role
from services.common.admission_mode import AdmissionMode
from services.common.model_spec import DEFAULT_MODEL_DIR, ModelSpec
from services.common.shared_flags import Arg, Bus, DeadAfter, Group, Metrics, Slos, joined, split

if TYPE_CHECKING:
    from perigee.stack_config import StackConfig

Value = str | int | float | bool | tuple[str, ...] | None


@dataclass(frozen=True)
class ServiceCmd:
    """A service's command line: ``python -m <module>`` and its fields as flags."""

    module: ClassVar[str] = ""

    def args(self) -> list[Arg]:
        out: list[Arg] = []
        for f in fields(self):
            v = getattr(self, f.name)
            flag = "--" + f.name.replace("_", "-")
            if isinstance(v, Group):
                out += v.args()
            elif v is True:
                out.append(Arg(flag))
            elif isinstance(v, tuple):
                out += [Arg(flag, str(x)) for x in v]
            elif v is not None and v is not False:
                out.append(Arg(flag, str(v)))
        return out

    def argv(self) -> list[str]:
        """``services.<role> --flag value ...`` (perigee up's children)."""
        return [self.module, *split(self.args())]

    def manifest_argv(self) -> list[str]:
        """``services.<role> --flag=value ...`` (compose.yaml, deploy/k8s)."""
        return [self.module, *joined(self.args())]


@dataclass(frozen=True)
class StoreCmd(ServiceCmd):
    """A node's KV store (services.store)."""

    module: ClassVar[str] = "services.store"
    bus: Bus
    node: Value
    host: Value = None
    advertise_host: Value = None
    port: Value = None
    block_size: Value = None
    block_bytes: Value = None
    capacity_blocks: Value = None
    ssd_dir: Value = None
    ssd_capacity_blocks: Value = None
    metrics: Metrics | None = None


@dataclass(frozen=True)
class WorkerCmd(ServiceCmd):
    """A prefill or decode worker (services.prefill, services.decode)."""

    role: ClassVar[Role]
    bus: Bus
    instance: Value
    node: Value
    engine: Value = None
    model_dir: Value = None
    block_size: Value = None
    speedup: Value = None
    report_interval: Value = None
    max_batch: Value = None
    lease: Value = None
    max_model_len: Value = None
    slos: Slos | None = None  # the TBT SLO: a decode's check in the baseline mode
    switchable: bool = False
    pod_role_label: bool = False
    load_format: Value = None
    kv_blocks: Value = None
    metrics: Metrics | None = None


@dataclass(frozen=True)
class PrefillCmd(WorkerCmd):
    """A prefill worker."""

    module: ClassVar[str] = "services.prefill"
    role: ClassVar[Role] = Role.PREFILL


@dataclass(frozen=True)
class DecodeCmd(WorkerCmd):
    """A decode worker."""

    module: ClassVar[str] = "services.decode"
    role: ClassVar[Role] = Role.DECODE


@dataclass(frozen=True)
class AdmissionCmd(ServiceCmd):
    """Admission (services.admission)."""

    module: ClassVar[str] = "services.admission"
    bus: Bus
    slos: Slos | None = None
    speedup: Value = None
    dead_after: DeadAfter | None = None
    block_size: Value = None
    cost_model: Value = None
    decode_time: Value = None
    id: Value = None  # unique among admissions (None: "admission", for one)
    metrics: Metrics | None = None


@dataclass(frozen=True)
class ConductorCmd(ServiceCmd):
    """A conductor (services.conductor)."""

    module: ClassVar[str] = "services.conductor"
    bus: Bus
    id: Value = None
    slos: Slos | None = None
    speedup: Value = None
    dead_after: DeadAfter | None = None
    block_size: Value = None
    cost_model: Value = None
    balancing_threshold: Value = None
    pd_controller: bool = False
    no_serve_when_idle: bool = False
    cpp_group: Value = None
    cpp_chunk_tokens: Value = None
    cpp_min_tokens: Value = None
    metrics: Metrics | None = None


@dataclass(frozen=True)
class GatewayCmd(ServiceCmd):
    """The OpenAI-compatible gateway (services.gateway); /metrics on its own port."""

    module: ClassVar[str] = "services.gateway"
    bus: Bus
    host: Value = None
    port: Value = None
    model_dir: Value = None
    block_size: Value = None
    slos: Slos | None = None
    dead_after: DeadAfter | None = None
    migration_limit: Value = None
    tool_call_parser: Value = None
    max_model_len: Value = None
    served_model_name: Value = None
    shutdown_grace: Value = None


@dataclass(frozen=True)
class AuthnCmd(ServiceCmd):
    """The NATS auth callout for serving pods (services.authn; Kubernetes only)."""

    module: ClassVar[str] = "services.authn"
    bus: Bus
    token_issuer: Value = None
    audience: Value = None
    role_account: tuple[str, ...] = ()
    metrics: Metrics | None = None


# -- perigee up ----------------------------------------------------------------------


def nodes(prefill: int, decode: int) -> list[tuple[type[WorkerCmd], str, str]]:
    """(worker class, instance, node) of a local stack: one node per instance."""
    out: list[tuple[type[WorkerCmd], str, str]] = [
        (PrefillCmd, f"prefill-{i}", f"p{i}") for i in range(prefill)
    ]
    return out + [(DecodeCmd, f"decode-{i}", f"d{i}") for i in range(decode)]


def local(c: "StackConfig", nats: str, block_bytes: int) -> list[tuple[str, ServiceCmd]]:
    """What ``perigee up`` starts for ``c``, by child name, in start order: the stores,
    the workers, admission, the conductors, the gateway. ``nats``: the services' bus;
    ``block_bytes``: the model's KV bytes per block. The metrics ports are drawn when
    the children start (Stack.observability)."""
    bus = Bus(nats, c.log_level)
    slos = Slos(c.ttft_slo, c.tbt_slo)
    dead = DeadAfter(c.dead_after)
    vllm = c.engine == "vllm"
    workers = nodes(c.prefill, c.decode)
    out: list[tuple[str, ServiceCmd]] = []
    for _, _, node in workers:
        ssd = bool(c.store_ssd_blocks)
        store = StoreCmd(
            bus,
            node,
            c.host,
            block_size=c.block_size,
            block_bytes=block_bytes,
            capacity_blocks=c.store_capacity_blocks,
            ssd_dir=str(Path(c.log_dir) / "ssd" / node) if ssd else None,
            ssd_capacity_blocks=c.store_ssd_blocks if ssd else None,
        )
        out.append((f"store-{node}", store))
    for kind, inst, node in workers:
        worker = kind(
            bus,
            inst,
            node,
            engine=c.engine,
            model_dir=c.model_dir,
            block_size=c.block_size,
            speedup=c.speedup,
            report_interval=c.report_interval,
            max_batch=c.max_batch,
            lease=c.lease_s or None,
            max_model_len=c.max_model_len or None,
            slos=Slos(None, c.tbt_slo),
            switchable=c.switchable,
            load_format=(vllm and c.load_format) or None,
            kv_blocks=(vllm and c.kv_blocks) or None,
        )
        out.append((inst, worker))
    model = c.cost_model or None
    predict = c.admission_mode == AdmissionMode.PREDICT
    for i in range(c.admissions):
        admission = AdmissionCmd(
            bus,
            slos,
            speedup=c.speedup,
            dead_after=dead,
            block_size=c.block_size,
            cost_model=model,
            decode_time=c.decode_time if predict else None,
            id=None if c.admissions == 1 else f"admission-{i}",
        )
        out.append(("admission" if c.admissions == 1 else f"admission-{i}", admission))
    cpp = c.cpp_group > 1
    for i in range(c.conductors):
        conductor = ConductorCmd(
            bus,
            f"conductor-{i}",
            slos,
            speedup=c.speedup,
            dead_after=dead,
            block_size=c.block_size,
            cost_model=model,
            balancing_threshold=c.balancing_threshold or None,
            pd_controller=c.pd_controller and i == 0,
            no_serve_when_idle=not c.serve_when_idle,
            cpp_group=c.cpp_group if cpp else None,
            cpp_chunk_tokens=(cpp and c.cpp_chunk_tokens) or None,
            cpp_min_tokens=(cpp and c.cpp_min_tokens) or None,
        )
        out.append(("conductor" if c.conductors == 1 else f"conductor-{i}", conductor))
    gateway = GatewayCmd(
        bus,
        c.host,
        c.port,
        model_dir=c.model_dir,
        block_size=c.block_size,
        slos=slos,
        dead_after=dead,
        migration_limit=c.migration_limit,
        tool_call_parser=c.tool_call_parser or None,
        max_model_len=c.max_model_len or None,
        served_model_name=c.served_model_name or None,
    )
    out.append(("gateway", gateway))
    return out


# -- compose.yaml --------------------------------------------------------------------

# Every server of the cluster; each service's own login is NATS_USER/NATS_PASSWORD.
COMPOSE_NATS = "nats://nats-0:4222,nats://nats-1:4222,nats://nats-2:4222"
COMPOSE_BLOCK_SIZE = 32
COMPOSE_STORE_PORT = 5555
METRICS_PORT = 9400  # every service but the gateway (its own port 8000)


def compose() -> dict[str, ServiceCmd]:
    """compose.yaml's perigee services, by compose service name: one prefill node and
    one decode node, the control plane and the gateway; SLOs and liveness are the
    services' defaults, the admission mode PERIGEE_ADMISSION_MODE."""
    bus = Bus(COMPOSE_NATS, None)
    metrics = Metrics(METRICS_PORT, "0.0.0.0")
    block = COMPOSE_BLOCK_SIZE
    # The image's model, models/tiny-llama: its KV bytes per block (the worker refuses
    # a store of any other block size).
    block_bytes = ModelSpec.from_dir(DEFAULT_MODEL_DIR).block_bytes(block)
    out: dict[str, ServiceCmd] = {
        "gateway": GatewayCmd(bus, "0.0.0.0", 8000, block_size=block),
        "admission": AdmissionCmd(bus, block_size=block, metrics=metrics),
        "conductor": ConductorCmd(bus, "conductor-0", block_size=block, metrics=metrics),
    }
    for kind, inst, node in nodes(1, 1):
        out[inst] = kind(bus, inst, node, "mock", block_size=block, speedup="1.0", metrics=metrics)
    for _, _, node in nodes(1, 1):
        name = f"store-{node}"  # --host: its name resolves to the container's own address
        out[name] = StoreCmd(
            bus,
            node,
            name,
            name,
            COMPOSE_STORE_PORT,
            block,
            block_bytes,
            4096,
            metrics=metrics,
        )
    return out


# -- deploy/k8s ----------------------------------------------------------------------

# The perigee-config ConfigMap's keys and the pod's downward API, as the kubelet expands them.
K8S_NATS = "$(NATS_URL)"
POD = "$(POD_NAME)"


@dataclass(frozen=True)
class Container:
    """A perigee container of deploy/k8s/base: its service and the comments its
    arguments carry in the manifest, by flag."""

    service: ServiceCmd
    notes: dict[str, str]


def k8s() -> dict[tuple[str, str], Container]:
    """deploy/k8s/base's perigee containers by (workload, container name). Every value
    the overlays change comes from perigee-config (kustomization.yaml)."""
    bus = Bus(K8S_NATS, None)
    metrics = Metrics(METRICS_PORT, "0.0.0.0")
    slos = Slos("$(TTFT_SLO)", "$(TBT_SLO)")
    block = COMPOSE_BLOCK_SIZE
    admission = AdmissionCmd(bus, slos, block_size=block, metrics=metrics, id=POD)
    conductor = ConductorCmd(bus, POD, slos, block_size=block, metrics=metrics)
    out = {
        ("perigee-admission", "admission"): Container(admission, {}),
        ("perigee-conductor", "conductor"): Container(conductor, {}),
        ("perigee-pd-controller", "conductor"): Container(
            replace(conductor, pd_controller=True), {}
        ),
        ("perigee-gateway", "gateway"): Container(
            GatewayCmd(bus, "0.0.0.0", 8000, "$(MODEL_DIR)", block, slos, shutdown_grace=5),
            {"--ttft-slo": "GET /v1/perigee/config reports both"},
        ),
        ("perigee-authn", "authn"): Container(
            AuthnCmd(
                bus,
                "$(SA_TOKEN_ISSUER)",
                "perigee-nats",
                ("worker=perigee-worker", "store=perigee-worker"),
                metrics,
            ),
            {},
        ),
    }
    for kind in (PrefillCmd, DecodeCmd):
        workload = f"perigee-{kind.role}"
        store = StoreCmd(
            bus,
            POD,
            "$(POD_IP)",
            "$(POD_IP)",
            COMPOSE_STORE_PORT,
            block,
            "$(KV_BLOCK_BYTES)",
            "$(STORE_CAPACITY_BLOCKS)",
            metrics=metrics,
        )
        out[(workload, "store")] = Container(
            store,
            {
                "--host": "the data ports listen on the pod's address only",
                "--block-bytes": "the model's KV bytes per block",
            },
        )
        worker = kind(
            bus,
            POD,
            POD,
            "$(ENGINE)",
            "$(MODEL_DIR)",
            block,
            slos=Slos(None, "$(TBT_SLO)"),
            switchable=True,
            pod_role_label=True,
            metrics=Metrics(METRICS_PORT + 1, "0.0.0.0"),
        )
        out[(workload, "worker")] = Container(
            worker, {"--tbt-slo": "a decode's check in the baseline admission mode"}
        )
    return out
