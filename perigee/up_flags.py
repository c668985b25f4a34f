"""``perigee up``'s flags, declared in groups (its ``--help`` shows them so). A flag
whose destination is a :class:`perigee.stack.StackConfig` field sets that field, and
its default is the field's: :func:`config_fields` hands them over by name, so
:func:`perigee.up.parse` only settles what needs more than a copy (the model, the
store's size, the engine's SLOs). The flags the services share with each other are the
groups of services.common.shared_flags; what each service is passed is
perigee.deploy_spec's."""

import argparse
import dataclasses
from typing import Any

from perigee.models import DEFAULT_MODEL_NAME, TINY_NAME
from perigee.stack import StackConfig
from perigee.supervise import RestartPolicy
from services.common import admission_mode
from services.common.shared_flags import Slos

# Shared memory per node store when --store-capacity-blocks is not given: 4096 blocks of
# the tiny model (512 MiB); 1,456 of SmolLM2-135M's 1.47 MB blocks (46k tokens). Stores
# prefault their arena, so three of them at 6 GiB each would not fit a 24 GiB machine.
STORE_BUDGET_BYTES = 2 << 30

# The service kinds whose flags `--<kind>-arg` passes on (python -m services.<kind>).
SERVICE_KINDS = ("gateway", "admission", "conductor", "prefill", "decode", "store")

FIELDS = {f.name for f in dataclasses.fields(StackConfig)}
_D = StackConfig()


def _share(v: str) -> float:
    x = float(v)
    if not 0.0 < x <= 1.0:
        raise argparse.ArgumentTypeError(f"{v}: a share in (0, 1]")
    return x


def _rate(v: str) -> float:
    x = float(v)
    if not x >= 0.0:
        raise argparse.ArgumentTypeError(f"{v}: traces a second, at least 0")
    return x


def flag(*names: str, **kw: Any) -> tuple[tuple[str, ...], dict[str, Any]]:
    return names, kw


GROUPS: dict[str, list[tuple[tuple[str, ...], dict[str, Any]]]] = {
    "bus": [
        flag(
            "--nats",
            dest="nats_url",
            metavar="NATS",
            help="use this NATS server (or comma list of a cluster's) instead of "
            "starting one; a login in the URL or in $NATS_USER/$NATS_PASSWORD",
        ),
        flag(
            "--nats-cluster",
            type=int,
            metavar="N",
            help="start N clustered nats-servers (JetStream replicas min(3, N)); "
            "services connect with every server's URL",
        ),
        flag(
            "--nats-max-payload",
            type=int,
            metavar="BYTES",
            help="the largest message on the bus (default: nats-server's, 1 MiB)",
        ),
        flag(
            "--nats-procs",
            type=int,
            metavar="N",
            help="GOMAXPROCS of the nats-servers started (default: a quarter of the "
            "cores, at least 1, as they share the host with every service; 0: Go's "
            "default, one per core; a GOMAXPROCS in the environment wins)",
        ),
        flag(
            "--durable-intake",
            action="store_true",
            help="requests on the JetStream work queues, redelivered by the streams "
            "should an admission or conductor die (default: core NATS, two stream hops "
            "and a claim fewer; the gateway resends what a dead one held)",
        ),
        flag(
            "--no-nats-auth",
            dest="nats_auth",
            action="store_false",
            help="an open bus (default: one NATS user per service, passwords drawn "
            "per run into <log-dir>/nats/credentials.json)",
        ),
    ],
    "addresses and gateway": [
        flag("--host", help="the address every service binds"),
        flag("--port", type=int, help="gateway HTTP port"),
        flag(
            "--api-key",
            help="gateway API key(s), comma list: clients send Authorization: Bearer KEY",
        ),
        flag(
            "--migration-limit",
            type=int,
            help="times a request whose prefill or decode instance died moves to another "
            "with the tokens it has and its prompt KV from the stores; past it "
            "(or with 0) the request fails with 503",
        ),
    ],
    "instances": [
        flag("--prefill", type=int, help="prefill instances"),
        flag("--decode", type=int, help="decode instances"),
        flag(
            "--conductors",
            type=int,
            help="conductor instances in one queue group (stateless, §5.3)",
        ),
    ],
    "engine and model": [
        flag(
            "--engine",
            choices=["mock", "vllm"],
            default="vllm",
            help="vllm (default): vLLM in each prefill/decode worker; mock: the "
            "paper's cost model with synthetic tokens",
        ),
        flag(
            "--model",
            "--model-dir",
            dest="model_dir",
            default=None,
            help=f"default: {DEFAULT_MODEL_NAME} (prepared by make install; "
            f"{TINY_NAME} with --engine mock); an "
            "HF-format folder (config.json + tokenizer; vllm: safetensors weights, "
            f"else dummy weights), a .gguf file (converted once), or {TINY_NAME}",
        ),
        flag(
            "--load-format",
            help="vllm: auto | dummy (default: auto if the model directory holds weights)",
        ),
        flag("--kv-blocks", type=int, help="vllm: paged-cache blocks per engine (0: by role)"),
        flag(
            "--gpu-memory-utilization",
            type=float,
            help="vllm on GPUs: each card's memory share, split among its engines (0: 0.8)",
        ),
        flag(
            "--tool-call-parser",
            help="vLLM's tool parser for tool_choice auto (hermes, llama3_json, mistral, ...)",
        ),
        flag("--block-size", type=int),
        flag("--speedup", help="mock engine speed-up (inf: no compute)"),
        flag(
            "--store-capacity-blocks",
            type=int,
            default=None,
            help=f"KV blocks per node store (default: {_D.store_capacity_blocks}, at "
            f"most {STORE_BUDGET_BYTES >> 30} GiB of shared memory per store)",
        ),
    ],
    "admission and placement": [
        flag(
            "--admission",
            admission_mode.FLAG,
            dest="admission_mode",
            default=None,
            choices=admission_mode.names(),
            help=f"admission mode of every service (default: ${admission_mode.ENV}, else "
            f"{admission_mode.DEFAULT})",
        ),
        flag("--cost-model", help="fitted cost model JSON (perigee profile --json)"),
        flag(
            "--balancing-threshold",
            help="kvcache_balancing_threshold: a number or 'adaptive'",
        ),
        flag(
            "--pd-controller",
            action="store_true",
            help="dynamic P/D ratio: conductor-0 switches roles (implies --switchable)",
        ),
        flag("--switchable", action="store_true", help="workers obey RoleSwitch"),
        flag(
            "--cpp-group",
            type=int,
            help="chunked pipeline parallelism: prefill instances per group (1: none; "
            "the mock engine only)",
        ),
        flag("--cpp-chunk-tokens", type=int, help="a pipeline's chunk (0: default)"),
        flag(
            "--cpp-min-tokens",
            type=int,
            help="tokens to compute below which no group is offered (0: default)",
        ),
        flag("--decode-time", type=float, help="predict admission: uniform decode time t_d, s"),
    ],
    "logs and supervision": [
        flag("--log-dir"),
        flag("--log-level"),
        flag(
            "--trace-sample",
            type=_share,
            help="share of requests traced, decided at the gateway and followed by every "
            "service (OpenTelemetry parentbased_traceidratio; default: %(default)s, every "
            "request up to --trace-rate)",
        ),
        flag(
            "--trace-rate",
            type=_rate,
            help="with every request traced (--trace-sample 1): at most this many new "
            "traces a second at each gateway, the others untraced in every service "
            "(PERIGEE_TRACE_RATE); 0: every request at any load; default: %(default)s",
        ),
        flag(
            "--max-restarts",
            type=int,
            default=RestartPolicy.max_restarts,
            help="a service that dies is restarted (with back-off); one that dies "
            "again after this many restarts within --restart-window is given up",
        ),
        flag(
            "--restart-window",
            type=float,
            default=RestartPolicy.window_s,
            help="seconds (default: %(default)s)",
        ),
    ],
}


def parser(description: str | None = None) -> argparse.ArgumentParser:
    """perigee up's parser: :data:`GROUPS`, the SLOs (shared_flags.Slos, unset: the
    engine's on this machine, perigee.stack.default_slos) and ``--<kind>-arg``."""
    p = argparse.ArgumentParser(prog="perigee up", description=description)
    for title, flags in GROUPS.items():
        g = p.add_argument_group(title)
        for names, kw in flags:
            dest = kw.get("dest", names[0].removeprefix("--").replace("-", "_"))
            if "default" not in kw and kw.get("action") is None and dest in FIELDS:
                kw = {**kw, "default": getattr(_D, dest)}
            g.add_argument(*names, **kw)
        if title == "admission and placement":
            Slos.add(
                g,  # type: ignore[arg-type]
                "every service's (unset: 15 s TTFT and 1.0 s TBT for vLLM on a CPU machine, "
                "else 30 and 0.1)",
                unset=True,
            )
    passing = p.add_argument_group("flags passed on to the services")
    for kind in SERVICE_KINDS:
        passing.add_argument(
            f"--{kind}-arg",
            action="append",
            default=[],
            metavar="FLAG",
            help=f"pass FLAG on to every {kind} service, written --{kind}-arg=--flag=value "
            f"(repeatable; its flags: python -m services.{kind} --help)",
        )
    return p


def config_fields(a: argparse.Namespace) -> dict[str, Any]:
    """The parsed flags that are StackConfig fields, by name."""
    return {k: v for k, v in vars(a).items() if k in FIELDS}


def service_args(a: argparse.Namespace) -> dict[str, list[str]]:
    """``--<kind>-arg`` by kind, the kinds given only."""
    return {k: list(v) for k in SERVICE_KINDS if (v := getattr(a, f"{k}_arg"))}
