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

import os
import signal
import sys
import threading
import time
from dataclasses import replace

from perigee import models, up_flags
from perigee.models import TINY_NAME
from perigee.rundir import RunCollision
from perigee.stack import Stack, StackConfig, StartAborted, default_slos
from perigee.supervise import RestartPolicy
from services.common import admission_mode
from services.common.kv_layout import store_too_small
from services.common.model_spec import ModelSpec


def parse(argv: list[str]) -> StackConfig:
    """perigee up's configuration: its flags (perigee.up_flags) copied onto StackConfig,
    and what takes more than a copy: the model, the stores' size, the engine's SLOs."""
    p = up_flags.parser(__doc__)
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
        budget = up_flags.STORE_BUDGET_BYTES // block
        capacity = max(1, min(StackConfig.store_capacity_blocks, budget))
    # Each worker refuses such a store too, but under supervision that would be a
    # restart loop; here the user hears it once, before anything starts.
    if short := store_too_small(capacity, spec.max_model_len, a.block_size):
        p.exit(2, f"perigee up: {short.replace('--capacity-blocks', '--store-capacity-blocks')}\n")
    slos = default_slos(a.engine)
    return replace(
        StackConfig(**up_flags.config_fields(a)),
        model_dir=str(model.path),
        served_model_name=model.name,
        store_capacity_blocks=capacity,
        ttft_slo=slos[0] if a.ttft_slo is None else a.ttft_slo,
        tbt_slo=slos[1] if a.tbt_slo is None else a.tbt_slo,
        switchable=a.switchable or a.pd_controller,
        supervise=True,
        restart_policy=RestartPolicy(max_restarts=a.max_restarts, window_s=a.restart_window),
        service_args=up_flags.service_args(a),
    )


# The service kinds whose flags `--<kind>-arg` passes on (python -m services.<kind>).
SERVICE_KINDS = up_flags.SERVICE_KINDS


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
