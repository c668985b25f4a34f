"""python -m services.conductor --nats URL --id conductor-0 ..."""

import argparse
import sys

import structlog
from nats.aio.client import Client as NATS

from services.common import (
    admission_mode,
    defaults,
    metrics,
    runner,
    shared_flags,
    shell,
)
from services.conductor import metrics as conductor_metrics
from services.conductor.placement_policy import DEFAULT_BALANCING_THRESHOLD, STRATEGIES
from services.conductor.service import RESERVE_AHEAD_QUEUE_S, ConductorConfig, ConductorService
from services.policy import chunk_timing


def _threshold(s: str) -> tuple[bool, float]:
    """'2.5' -> fixed 2.5; 'adaptive' -> tuned from the default; 'adaptive:3' -> from 3."""
    adaptive = s == "adaptive" or s.startswith("adaptive:")
    value = s.partition(":")[2] if adaptive else s
    try:
        t = float(value) if value else DEFAULT_BALANCING_THRESHOLD
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number or 'adaptive': {s!r}") from None
    if not t > 0 or (adaptive and t < 1.0):
        raise argparse.ArgumentTypeError("the threshold must be > 0 (adaptive: >= 1)")
    return adaptive, t


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m services.conductor", description=__doc__)
    shared_flags.Bus.add(ap)
    ap.add_argument("--id", default="conductor-0", help="conductor id (its events subject)")
    ap.add_argument(
        "--block-size", type=int, default=defaults.BLOCK_SIZE, help="tokens per KV block"
    )
    shared_flags.Slos.add(ap, "a placement predicted over it is rejected (429)")
    ap.add_argument(
        "--balancing-threshold",
        type=_threshold,
        default=str(DEFAULT_BALANCING_THRESHOLD),
        help="pull a remote prefix when best/local prefix exceeds this "
        "(kvcache_balancing_threshold); 'adaptive' or 'adaptive:START' tunes it online",
    )
    ap.add_argument(
        "--cost-model",
        default="",
        help="fitted cost model JSON (perigee profile --json); default: the analytic model",
    )
    ap.add_argument(
        "--ttft-margin",
        type=float,
        default=0.9,
        help="share of the TTFT SLO placements plan to fill (the rest absorbs the spread "
        "of actual TTFT around the prediction)",
    )
    ap.add_argument(
        "--no-ttft-feedback",
        action="store_true",
        help="predict TTFT from the fitted costs alone (no observed/predicted correction)",
    )
    ap.add_argument(
        "--no-serve-when-idle",
        action="store_true",
        help="reject a request predicted over its SLO even on an idle instance (the "
        "paper's Algorithm 1; default: an idle instance takes it, best effort)",
    )
    ap.add_argument(
        "--cpp-group",
        type=int,
        default=1,
        help="chunked pipeline parallelism: prefill instances per group (1: none)",
    )
    ap.add_argument(
        "--cpp-chunk-tokens",
        type=int,
        default=chunk_timing.DEFAULT_CHUNK_TOKENS,
        help="a pipeline's chunk (the paper's prefill_chunk), tokens",
    )
    ap.add_argument(
        "--cpp-min-tokens",
        type=int,
        default=chunk_timing.DEFAULT_MIN_TOKENS,
        help="tokens to compute below which a request is not offered to a group",
    )
    # Whether placement rejects on predicted TBT (not in baseline: decode rejects).
    admission_mode.add_argument(ap)
    ap.add_argument(
        "--pd-controller",
        action="store_true",
        help="run the dynamic P/D ratio controller and publish RoleSwitch (one conductor only)",
    )
    ap.add_argument("--pd-interval", type=float, default=10.0, help="P/D controller period, s")
    ap.add_argument("--pd-window", type=float, default=60.0, help="P/D load sample window, s")
    ap.add_argument("--pd-cooldown", type=float, default=30.0, help="P/D hold after a change, s")
    ap.add_argument("--strategy", choices=STRATEGIES, default="global", help="placement strategy")
    ap.add_argument(
        "--speedup", type=float, default=1.0, help="cost-model speedup ('inf': no compute)"
    )
    shared_flags.DeadAfter.add(ap, "no placement on it")
    ap.add_argument("--tx-timeout", type=float, default=2.0, help="store request timeout, s")
    ap.add_argument(
        "--reserve-ahead-queue-ms",
        type=float,
        default=RESERVE_AHEAD_QUEUE_S * 1e3,
        help="send a placement's TxAllocates ahead of its task (the stores answer the "
        "prefill instance) when the instance's predicted queue is at most this long; "
        "negative: never; default %(default)g",
    )
    ap.add_argument(
        "--report-grace",
        type=float,
        default=0.05,
        help="a load report must be this much newer than a dispatch to cover it, s",
    )
    shared_flags.Intake.add(ap, "the placement claim")
    metrics.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.block_size <= 0:
        ap.error("--block-size must be positive")
    admission_mode.settle(ap, args)
    return args


def config_from_args(args: argparse.Namespace) -> ConductorConfig:
    return ConductorConfig(
        durable_intake=args.durable_intake,
        intake_ack_wait_s=args.intake_ack_wait,
        intake_patience_s=args.intake_patience,
        conductor_id=args.id,
        block_size=args.block_size,
        ttft_slo_s=args.ttft_slo,
        tbt_slo_s=args.tbt_slo,
        balancing_threshold=args.balancing_threshold[1],
        adaptive_threshold=args.balancing_threshold[0],
        cost_model=args.cost_model,
        tbt_check=admission_mode.behaviour(args.admission_mode).placement_tbt_check,
        ttft_feedback=not args.no_ttft_feedback,
        ttft_margin=args.ttft_margin,
        serve_when_idle=not args.no_serve_when_idle,
        cpp_group=args.cpp_group,
        cpp_chunk_tokens=args.cpp_chunk_tokens,
        cpp_min_tokens=args.cpp_min_tokens,
        pd_controller=args.pd_controller,
        pd_interval_s=args.pd_interval,
        pd_window_s=args.pd_window,
        pd_cooldown_s=args.pd_cooldown,
        speedup=args.speedup,
        dead_after_s=args.dead_after,
        strategy=args.strategy,
        tx_timeout_s=args.tx_timeout,
        report_grace_s=args.report_grace,
        reserve_ahead_queue_s=args.reserve_ahead_queue_ms / 1e3,
    )


async def amain(args: argparse.Namespace) -> int:
    def build(nc: NATS) -> ConductorService:
        structlog.get_logger().info("admission_mode", mode=str(args.admission_mode))
        return ConductorService(nc, config_from_args(args))

    return await shell.serve(
        "conductor",
        args,
        build,
        connection=args.id,
        collector=conductor_metrics.conductor_collector,
    )


def main(argv: list[str] | None = None) -> int:
    return runner.run(amain(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
