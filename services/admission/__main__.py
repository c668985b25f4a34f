"""python -m services.admission --nats URL --admission-mode early ..."""

import argparse
import sys

import structlog
from nats.aio.client import Client as NATS

from services.admission.admission_policy import ADMISSION_POLICIES
from services.admission.service import AdmissionConfig, AdmissionService
from services.common import (
    admission_mode,
    defaults,
    metrics,
    runner,
    shared_flags,
    shell,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m services.admission", description=__doc__)
    shared_flags.Bus.add(ap)
    ap.add_argument(
        "--block-size", type=int, default=defaults.BLOCK_SIZE, help="tokens per KV block (hashes)"
    )
    shared_flags.Slos.add(ap, "a request its pools would serve over it is refused (429)")
    ap.add_argument(
        "--speedup", type=float, default=1.0, help="cost-model speedup ('inf': no compute)"
    )
    admission_mode.add_argument(ap)
    # Kept for the deployments written before --admission-mode (compose and k8s
    # manifests copied from this repository said --policy=early): it may only agree.
    ap.add_argument(
        "--policy",
        choices=sorted(ADMISSION_POLICIES),
        default=None,
        help=f"deprecated: {admission_mode.FLAG} (a contradiction is an error)",
    )
    shared_flags.DeadAfter.add(ap, "out of the pools' loads")
    ap.add_argument(
        "--id",
        default="admission",
        help="this admission's name, unique among admissions (its presence beats)",
    )
    ap.add_argument(
        "--cost-model",
        default="",
        help="fitted cost model JSON (perigee profile --json); default: the analytic model",
    )
    ap.add_argument(
        "--decode-time",
        type=float,
        default=5.0,
        help="predict: uniform decode time t_d of every request, s (paper §4.3.4)",
    )
    shared_flags.Intake.add(ap)
    metrics.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.block_size <= 0:
        ap.error("--block-size must be positive")
    admission_mode.settle(ap, args, legacy=("--policy", args.policy))
    return args


def config_from_args(args: argparse.Namespace) -> AdmissionConfig:
    return AdmissionConfig(
        admission_id=args.id,
        durable_intake=args.durable_intake,
        intake_ack_wait_s=args.intake_ack_wait,
        intake_patience_s=args.intake_patience,
        block_size=args.block_size,
        ttft_slo_s=args.ttft_slo,
        tbt_slo_s=args.tbt_slo,
        speedup=args.speedup,
        policy=admission_mode.behaviour(args.admission_mode).admission_policy,
        dead_after_s=args.dead_after,
        cost_model=args.cost_model,
        decode_time_s=args.decode_time,
    )


async def amain(args: argparse.Namespace) -> int:
    def build(nc: NATS) -> AdmissionService:
        structlog.get_logger().info("admission_mode", mode=str(args.admission_mode))
        return AdmissionService(nc, config_from_args(args))

    return await shell.serve("admission", args, build)


def main(argv: list[str] | None = None) -> int:
    return runner.run(amain(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
