"""``python -m services.prefill`` and ``python -m services.decode``: the arguments, the
engine and store set-up, and the run-until-signal loop, for either role; the worker
itself comes from its role's builder, which the entry point hands over (see
:mod:`services.worker.settings`)."""

import argparse
import asyncio
from collections.abc import Mapping
from pathlib import Path

import structlog

from bus_schemas.roles import Role
from services.common import admission_mode, bus, defaults, metric_collectors, metrics, shared_flags
from services.common import calibrator as calibration
from services.common.cost_model import CostModel
from services.common.kv_layout import KVLayout, store_too_small
from services.common.logging import configure
from services.common.model_spec import DEFAULT_MODEL_DIR, ModelSpec
from services.common.shutdown import StopEvent
from services.engine import ENGINE_KINDS, make_engine
from services.engine.vllm import options as vllm_options
from services.store.client.store_client import StoreClient, TransferError
from services.transfer import data_auth
from services.worker import pod_role
from services.worker.role_host import RoleHost
from services.worker.settings import Builder, make_worker, settings_from_args
from services.worker.warmup import calibrate
from tracing import setup_tracing, shutdown_tracing


def parser(role: str, node: str, doc: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m services.{role}", description=doc)
    shared_flags.Bus.add(p)
    p.add_argument("--instance", default=f"{role}-0", help="instance id (subjects, load reports)")
    p.add_argument("--node", default=node, help="node whose store this instance uses")
    p.add_argument("--engine", default="mock", choices=ENGINE_KINDS)
    p.add_argument("--model-dir", default=None, help="model directory with config.json")
    p.add_argument(
        "--block-size", type=int, default=defaults.BLOCK_SIZE, help="tokens per KV block"
    )
    p.add_argument(
        "--speedup",
        type=float,
        default=1.0,
        help="divide cost-model times by this (inf: no compute time)",
    )
    p.add_argument(
        "--report-interval", type=float, default=0.1, help="seconds between load reports"
    )
    p.add_argument(
        "--engine-speedup",
        type=float,
        default=0.0,
        help="mock engine: run at this speedup instead of --speedup (a machine "
        "slower or faster than the services assume; 0: --speedup)",
    )
    p.add_argument(
        "--calibration-warmup",
        type=int,
        default=-1,
        help="prefills (and decode requests) the calibration warm-up runs before "
        "the first load report (-1: 6, or 3 when a fit is kept on disk)",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=128,
        help="decode running batch limit (a prefill instance uses it if switched)",
    )
    p.add_argument(
        "--switchable",
        action="store_true",
        help="obey RoleSwitch on perigee.ctl.role: drain, then serve the other role "
        "with the same engine (dynamic P/D ratio)",
    )
    p.add_argument(
        "--pod-role-label",
        action="store_true",
        help="in a Kubernetes pod named --instance: keep its label perigee.io/role equal "
        "to the role served (the pod's service account may patch pods), and start in "
        "the role that label already names (read from --pod-labels-file)",
    )
    p.add_argument(
        "--pod-labels-file",
        default=str(pod_role.LABELS_FILE),
        help="the downward API file of the pod's labels (default: %(default)s)",
    )
    # As decode in baseline mode: reject a prefilled request over the TBT SLO.
    admission_mode.add_argument(p)
    shared_flags.Slos.add(
        p, "a decode instance's check of a prefilled request in the baseline mode", ttft=False
    )
    p.add_argument(
        "--no-write-back",
        action="store_true",
        help="as decode: keep the answer's KV out of the stores (decode write-back is on "
        "by default: a conversation's next turn reuses the previous answer)",
    )
    p.add_argument(
        "--store-timeout",
        type=float,
        default=30.0,
        help="seconds to wait for the node's store at start",
    )
    p.add_argument(
        "--commit-timeout",
        type=float,
        default=2.0,
        help="as decode: seconds to wait for the store to commit decode_tx",
    )
    p.add_argument(
        "--lease",
        type=float,
        default=defaults.TX_LEASE_S,
        help="lease of the store transactions this worker holds, s; renewed "
        "every third of it while the request lives",
    )
    vllm_options.add_arguments(p)
    metrics.add_arguments(p)
    return p


def parse_args(role: str, node: str, doc: str | None, argv: list[str] | None) -> argparse.Namespace:
    p = parser(role, node, doc)
    args = p.parse_args(argv)
    admission_mode.settle(p, args)
    return args


async def run(role: str, args: argparse.Namespace, builders: Mapping[str, Builder]) -> int:
    """Exit codes: 0 stopped by a signal, 1 engine died or store unreachable,
    2 engine unavailable or store layout mismatch."""
    started_as = role
    if args.switchable and args.pod_role_label:
        # Switched before its container restarted: it goes on in the role it had.
        role = pod_role.role_from_labels(Path(args.pod_labels_file)) or role
    log = configure(role, args.log_level)
    if role != started_as:
        log.info("role_from_pod_label", role=role, started_as=started_as)
    structlog.contextvars.bind_contextvars(instance=args.instance)
    log.info("admission_mode", mode=str(args.admission_mode))
    setup_tracing(role)
    data_auth.data_key()  # a placeholder key stops the worker now, not at its first transfer
    spec = ModelSpec.from_dir(args.model_dir)
    layout = KVLayout(spec, args.block_size)
    cost = CostModel.llama3_70b_a800(speedup=args.speedup)
    engine_speedup = args.engine_speedup or args.speedup
    calib = calibration.for_worker(
        args.engine, args.model_dir or DEFAULT_MODEL_DIR, spec.name, cost, engine_speedup
    )
    try:
        engine = make_engine(
            args.engine,
            spec,
            cost.with_speedup(engine_speedup),
            max_batch=args.max_batch,
            role=role,
            layout=layout,
            vllm=vllm_options.from_args(args, str(args.model_dir or DEFAULT_MODEL_DIR)),
        )
    except NotImplementedError as e:
        log.error("engine_unavailable", engine=args.engine, error=str(e))
        return 2
    stop = StopEvent()
    bus.install_signal_handlers(stop)
    nc = await bus.connect(
        args.nats, name=f"{role}-{args.instance}", kind="worker", sender=args.instance
    )
    try:
        store = await StoreClient.connect(nc, args.node, timeout=args.store_timeout)
    except TransferError as e:
        log.error("store_unreachable", node=args.node, error=str(e))
        await bus.drain(nc)
        return 1
    info = store.info
    if info.block_size != args.block_size or info.block_bytes != layout.block_bytes:
        log.error(
            "store_layout_mismatch",
            store_block_size=info.block_size,
            store_block_bytes=info.block_bytes,
            block_size=args.block_size,
            block_bytes=layout.block_bytes,
        )
        await store.close()
        await bus.drain(nc)
        return 2
    max_len = args.max_model_len or spec.max_model_len
    if short := store_too_small(info.capacity_blocks, max_len, args.block_size):
        log.error("store_too_small", node=args.node, detail=short)
        await store.close()
        await bus.drain(nc)
        return 2
    await engine.start()
    roles = (role, Role(role).other) if args.switchable else (role,)
    engine.on_decode_step = calib.decode_step
    # /ready: not before the calibration warm-up is done and a worker takes tasks.
    mserver = await metrics.start_from_args(
        args, roles, metric_collectors.worker_collector(), ready=lambda: False
    )
    try:
        warm = args.calibration_warmup
        if warm < 0:
            warm = 3 if calib.fit.prior is not cost else 6
        # Before the first load report, so the gateway's /ready waits for it.
        if not await calibrate(engine, layout, calib, roles, warm, stop):
            return 0
        calib.save()
        cost = calib.model()
        settings = settings_from_args(args, layout, cost, calibrator=calib, builders=builders)
        if args.switchable:
            on_role = None
            if args.pod_role_label:
                try:
                    on_role = pod_role.PodRoleLabel(
                        pod_role.PodApi.in_cluster(args.instance)
                    ).publish
                except pod_role.PodApiError as e:
                    log.warning("pod_role_label_off", error=str(e))
            host = RoleHost(nc, store, engine, role, settings, on_role)
            if mserver is not None:
                mserver.ready = host.serving.is_set  # not while draining for a switch
            return await host.run(stop)
        worker = make_worker(role, nc, store, engine, settings)
        await worker.start()
        if mserver is not None:
            mserver.ready = lambda: not worker.dead.is_set()
        dead = asyncio.ensure_future(worker.dead.wait())
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({dead, stopped}, return_when=asyncio.FIRST_COMPLETED)
        dead.cancel()
        stopped.cancel()
        log.info(f"{role}_stopping", engine_dead=worker.dead.is_set())
        await worker.close()
        return 1 if worker.dead.is_set() else 0
    finally:
        calib.save()
        await engine.stop()
        if mserver is not None:
            await mserver.close()
        await store.close()
        await bus.drain(nc)
        shutdown_tracing()
