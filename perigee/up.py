"""``perigee up``: nats-server plus every service, until Ctrl-C.

How it stops. A terminal's Ctrl-C sends SIGINT to its whole foreground process group.
Only ``perigee up`` is in that group: every service and nats-server runs in a session
of its own, so none of them acts on the terminal's signal by itself (a bus that died
first left the services draining against nothing). ``perigee up`` alone orders the
stop, on SIGINT or SIGTERM, during start-up as well as while serving: SIGTERM to the
gateway, then the conductors and admission, the workers, the stores, each tier bounded
(:meth:`perigee.stack.Stack.stop`), nats-server last; it exits 0. A second signal
SIGKILLs everything at once. If ``perigee up`` itself is killed, the kernel sends each
child SIGTERM (``PR_SET_PDEATHSIG``, :mod:`perigee.procs`), and every service exits on
SIGTERM within a few seconds whatever its bus is doing (:mod:`services.common.shutdown`).

A service that dies while serving is restarted with back-off and the rest keep serving;
one that keeps dying is given up after ``--max-restarts`` within ``--restart-window``
(:mod:`perigee.supervise`), and ``perigee up`` says so.
"""

import argparse
import os
import signal
import sys
import threading
import time

from perigee import models
from perigee.models import DEFAULT_MODEL_NAME, TINY_NAME
from perigee.rundir import RunCollision
from perigee.stack import Stack, StackConfig, StartAborted, default_slos
from perigee.supervise import RestartPolicy
from services.common import admission_mode
from services.common.kv_layout import store_too_small
from services.common.model_spec import ModelSpec

# Shared memory per node store when --store-capacity-blocks is not given: 4096 blocks of
# the tiny model (512 MiB); 1,456 of SmolLM2-135M's 1.47 MB blocks (46k tokens). Stores
# prefault their arena, so three of them at 6 GiB each would not fit a 24 GiB machine.
STORE_BUDGET_BYTES = 2 << 30


def parse(argv: list[str]) -> StackConfig:
    d = StackConfig()
    p = argparse.ArgumentParser(prog="perigee up", description=__doc__)
    p.add_argument(
        "--nats",
        default=None,
        help="use this NATS server (or comma list of a cluster's) instead of "
        "starting one; a login in the URL or in $NATS_USER/$NATS_PASSWORD",
    )
    p.add_argument(
        "--nats-cluster",
        type=int,
        default=d.nats_cluster,
        metavar="N",
        help="start N clustered nats-servers (JetStream replicas min(3, N)); "
        "services connect with every server's URL",
    )
    p.add_argument(
        "--nats-max-payload",
        type=int,
        default=None,
        metavar="BYTES",
        help="the largest message on the bus (default: nats-server's, 1 MiB)",
    )
    p.add_argument(
        "--no-nats-auth",
        dest="nats_auth",
        action="store_false",
        help="an open bus (default: one NATS user per service, passwords drawn "
        "per run into <log-dir>/nats/credentials.json)",
    )
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port, help="gateway HTTP port")
    p.add_argument("--prefill", type=int, default=d.prefill, help="prefill instances")
    p.add_argument("--decode", type=int, default=d.decode, help="decode instances")
    p.add_argument(
        "--engine",
        choices=["mock", "vllm"],
        default="vllm",
        help="vllm (default): vLLM in each prefill/decode worker; mock: the "
        "paper's cost model with synthetic tokens",
    )
    p.add_argument(
        "--model",
        "--model-dir",
        dest="model_dir",
        default=None,
        help=f"default: {DEFAULT_MODEL_NAME} (prepared by make install; "
        f"{TINY_NAME} with --engine mock); an "
        "HF-format folder (config.json + tokenizer; vllm: safetensors weights, "
        f"else dummy weights), a .gguf file (converted once), or {TINY_NAME}",
    )
    p.add_argument(
        "--load-format",
        default=d.load_format,
        help="vllm: auto | dummy (default: auto if the model directory holds weights)",
    )
    p.add_argument(
        "--kv-blocks",
        type=int,
        default=d.kv_blocks,
        help="vllm: paged-cache blocks per engine (0: by role)",
    )
    p.add_argument(
        "--tool-call-parser",
        default=d.tool_call_parser,
        help="vLLM's tool parser for tool_choice auto (hermes, llama3_json, mistral, ...)",
    )
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--speedup", default=d.speedup, help="mock engine speed-up (inf: no compute)")
    p.add_argument(
        "--store-capacity-blocks",
        type=int,
        default=None,
        help=f"KV blocks per node store (default: {d.store_capacity_blocks}, at "
        f"most {STORE_BUDGET_BYTES >> 30} GiB of shared memory per store)",
    )
    p.add_argument(
        "--ttft-slo",
        type=float,
        default=None,
        help="TTFT SLO, s (default: 15 for vLLM on a CPU machine, else 30)",
    )
    p.add_argument(
        "--tbt-slo",
        type=float,
        default=None,
        help="TBT SLO, s (default: 1.0 for vLLM on a CPU machine, else 0.1)",
    )
    p.add_argument(
        "--admission",
        admission_mode.FLAG,
        dest="admission_mode",
        default=None,
        choices=admission_mode.names(),
        help=f"admission mode of every service (default: ${admission_mode.ENV}, else "
        f"{admission_mode.DEFAULT})",
    )
    p.add_argument(
        "--conductors",
        type=int,
        default=d.conductors,
        help="conductor instances in one queue group (stateless, §5.3)",
    )
    p.add_argument(
        "--cost-model", default=d.cost_model, help="fitted cost model JSON (perigee profile --json)"
    )
    p.add_argument(
        "--balancing-threshold",
        default=d.balancing_threshold,
        help="kvcache_balancing_threshold: a number or 'adaptive'",
    )
    p.add_argument(
        "--pd-controller",
        action="store_true",
        help="dynamic P/D ratio: conductor-0 switches roles (implies --switchable)",
    )
    p.add_argument("--switchable", action="store_true", help="workers obey RoleSwitch")
    p.add_argument(
        "--cpp-group",
        type=int,
        default=1,
        help="chunked pipeline parallelism: prefill instances per group (1: none; "
        "the mock engine only)",
    )
    p.add_argument(
        "--cpp-chunk-tokens", type=int, default=0, help="a pipeline's chunk (0: default)"
    )
    p.add_argument(
        "--cpp-min-tokens",
        type=int,
        default=0,
        help="tokens to compute below which no group is offered (0: default)",
    )
    p.add_argument(
        "--decode-time",
        type=float,
        default=d.decode_time,
        help="predict admission: uniform decode time t_d, s",
    )
    p.add_argument(
        "--migration-limit",
        type=int,
        default=d.migration_limit,
        help="times a request whose prefill or decode instance died moves to another "
        "with the tokens it has and its prompt KV from the stores; past it "
        "(or with 0) the request fails with 503",
    )
    p.add_argument("--log-dir", default=d.log_dir)
    p.add_argument("--log-level", default=d.log_level)
    p.add_argument(
        "--api-key",
        default=d.api_key,
        help="gateway API key(s), comma list: clients send Authorization: Bearer KEY",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=RestartPolicy.max_restarts,
        help="a service that dies is restarted (with back-off); one that dies "
        "again after this many restarts within --restart-window is given up",
    )
    p.add_argument(
        "--restart-window",
        type=float,
        default=RestartPolicy.window_s,
        help="seconds (default: %(default)s)",
    )
    for kind in SERVICE_KINDS:
        p.add_argument(
            f"--{kind}-arg",
            action="append",
            default=[],
            metavar="FLAG",
            help=f"pass FLAG on to every {kind} service, written --{kind}-arg=--flag=value "
            f"(repeatable; its flags: python -m services.{kind} --help)",
        )
    a = p.parse_args(argv)
    admission_mode.settle(p, a)
    if a.cpp_group > 1 and a.engine != "mock":
        # A vLLM anchor would compute the whole prompt again after the stages.
        p.error("--cpp-group runs on the mock engine only (vLLM stages: issue 16 item 4)")
    try:
        # The mock engine's tokens are synthetic: real weights would serve nothing there.
        model = models.resolve(a.model_dir or (TINY_NAME if a.engine == "mock" else None))
    except models.ModelNotReady as e:
        p.exit(2, f"perigee up: {e}\n")
    spec = ModelSpec.from_dir(model.path)
    capacity = a.store_capacity_blocks
    if capacity is None:  # a real model's blocks are large: bound each store's memory
        block = spec.block_bytes(a.block_size)
        capacity = max(1, min(d.store_capacity_blocks, STORE_BUDGET_BYTES // block))
    # Each worker refuses such a store too, but under supervision that would be a
    # restart loop; here the user hears it once, before anything starts.
    if short := store_too_small(capacity, spec.max_model_len, a.block_size):
        p.exit(2, f"perigee up: {short.replace('--capacity-blocks', '--store-capacity-blocks')}\n")
    slos = default_slos(a.engine)
    return StackConfig(
        nats_url=a.nats,
        nats_cluster=a.nats_cluster,
        nats_max_payload=a.nats_max_payload,
        nats_auth=a.nats_auth,
        host=a.host,
        port=a.port,
        prefill=a.prefill,
        decode=a.decode,
        engine=a.engine,
        load_format=a.load_format,
        kv_blocks=a.kv_blocks,
        tool_call_parser=a.tool_call_parser,
        model_dir=str(model.path),
        served_model_name=model.name,
        block_size=a.block_size,
        speedup=a.speedup,
        store_capacity_blocks=capacity,
        ttft_slo=slos[0] if a.ttft_slo is None else a.ttft_slo,
        tbt_slo=slos[1] if a.tbt_slo is None else a.tbt_slo,
        admission_mode=a.admission_mode,
        log_dir=a.log_dir,
        log_level=a.log_level,
        api_key=a.api_key,
        migration_limit=a.migration_limit,
        conductors=a.conductors,
        cost_model=a.cost_model,
        balancing_threshold=a.balancing_threshold,
        pd_controller=a.pd_controller,
        switchable=a.switchable or a.pd_controller,
        cpp_group=a.cpp_group,
        cpp_chunk_tokens=a.cpp_chunk_tokens,
        cpp_min_tokens=a.cpp_min_tokens,
        decode_time=a.decode_time,
        supervise=True,
        restart_policy=RestartPolicy(max_restarts=a.max_restarts, window_s=a.restart_window),
        service_args={
            k: list(v) for k in SERVICE_KINDS if (v := getattr(a, f"{k.replace('-', '_')}_arg"))
        },
    )


# The service kinds whose flags `--<kind>-arg` passes on (python -m services.<kind>).
SERVICE_KINDS = ("gateway", "admission", "conductor", "prefill", "decode", "store")


def main(argv: list[str]) -> int:
    cfg = parse(argv)
    stop = threading.Event()
    stopping_since = [0.0]
    stack = Stack(cfg)

    def on_supervised(e) -> None:  # from the supervisor's thread
        print(
            f"perigee: {e.describe(cfg.restart_policy)}; see {stack.cfg.log_dir}/{e.name}.log",
            file=sys.stderr if e.kind == "gave_up" else sys.stdout,
            flush=True,
        )

    stack.on_supervised = on_supervised

    def on_signal(signum: int, _frame) -> None:
        if stop.is_set():  # the second one: nothing waits any longer
            stack.kill_all()
            os.write(2, b"perigee: killed everything\n")
            os._exit(0)
        stopping_since[0] = time.monotonic()
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    print(
        f"perigee: starting {cfg.prefill} prefill + {cfg.decode} decode ({cfg.engine} engine, "
        f"model {cfg.served_model_name} from {cfg.model_dir})...",
        flush=True,
    )
    try:
        stack.start(abort=stop)
    except StartAborted:  # start() has stopped what it had started
        print(
            f"perigee: stopped during start-up in {time.monotonic() - stopping_since[0]:.1f} s",
            flush=True,
        )
        return 0
    except RunCollision as e:  # nothing was started nor written
        print(f"perigee up: refused: {e}", file=sys.stderr, flush=True)
        return 1
    except (RuntimeError, TimeoutError) as e:  # start() stopped what it had started
        print(f"perigee: start failed: {e}", file=sys.stderr, flush=True)
        return 1
    key = (cfg.api_key or "").split(",")[0].strip()
    auth = f"-H 'Authorization: Bearer {key}' " if key else ""
    log_dir = stack.cfg.log_dir  # absolute
    bus = stack.nats.url if stack.nats else stack.nats_url
    if stack.nats and cfg.nats_auth:
        bus += f", logins in {log_dir}/nats/credentials.json"
    env = f"source {stack.env_file}" if stack.env_file else ""
    print(
        f"perigee: ready at {stack.url}  (NATS {bus}; logs in {log_dir}/)\n"
        f"  curl {stack.url}/v1/chat/completions {auth}-H 'Content-Type: application/json' "
        f'-d \'{{"model": "{cfg.served_model_name}", "messages": [{{"role": "user", '
        f'"content": "What is the capital of France?"}}], "temperature": 0}}\'\n'
        f"  bus: {env}   (PERIGEE_NATS_URL: the bus with the admin login; "
        "README: Talking to the bus directly)\n"
        f"  spans: {stack.spans_file}   metrics targets: {stack.metrics_targets_file}\n"
        "perigee: Ctrl-C stops everything",
        flush=True,
    )
    try:
        while not stop.wait(0.5):  # a timed wait: the signal handler runs between them
            pass
    finally:
        since = stopping_since[0] or time.monotonic()
        print("perigee: stopping (again to kill everything now)...", flush=True)
        stack.stop()
        print(f"perigee: stopped in {time.monotonic() - since:.1f} s", flush=True)
    return 0
