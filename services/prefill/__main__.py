"""``python -m services.prefill``: one prefill instance bound to its node's store."""

import argparse
import sys

from services.common import runner, worker_main
from services.prefill.worker import PrefillWorker


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return worker_main.parser("prefill", "p0", __doc__).parse_args(argv)


def make_worker(args, nc, store, engine, layout, cost) -> PrefillWorker:
    return PrefillWorker(nc, store, engine, instance=args.instance, node=args.node,
                         layout=layout, cost=cost, report_interval=args.report_interval,
                         lease_s=args.lease)


def main(argv: list[str] | None = None) -> int:
    return runner.run(worker_main.run("prefill", parse_args(argv), make_worker))


if __name__ == "__main__":
    sys.exit(main())
