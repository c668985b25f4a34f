"""``python -m services.decode``: one decode instance bound to its node's store."""

import argparse
import sys

from services.common import runner, worker_main
from services.decode.worker import DecodeWorker


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = worker_main.parser("decode", "d0", __doc__)
    p.add_argument("--commit-timeout", type=float, default=2.0,
                   help="seconds to wait for the store to commit decode_tx")
    return p.parse_args(argv)


def make_worker(args, nc, store, engine, layout, cost) -> DecodeWorker:
    admit = None
    if args.tbt_gate_slo > 0:
        from services.decode.side_check import DecodeSideCheck

        admit = DecodeSideCheck(cost, args.tbt_gate_slo,
                                max_batch=getattr(args, "max_batch", 0)).as_admit_hook()
    return DecodeWorker(nc, store, engine, instance=args.instance, node=args.node,
                        layout=layout, report_interval=args.report_interval,
                        commit_timeout=args.commit_timeout, admit=admit, lease_s=args.lease)


def main(argv: list[str] | None = None) -> int:
    return runner.run(worker_main.run("decode", parse_args(argv), make_worker))


if __name__ == "__main__":
    sys.exit(main())
