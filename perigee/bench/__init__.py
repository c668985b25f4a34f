"""``perigee bench <name>``: benchmarks, each measured beside its baseline in one run."""

import importlib
import sys

BENCHES = {
    "pipeline": "perigee.bench.pipeline",
    "reuse": "perigee.bench.reuse",
    "transfer": "perigee.bench.transfer",
    "ship": "perigee.bench.ship",
    "store": "perigee.bench.store",
    "conductor": "perigee.bench.conductor",
    "calibration": "perigee.bench.calibration",
    "slo": "perigee.bench.slo",
    "migration": "perigee.bench.migration",
    "chaos": "perigee.bench.chaos",
    "agreement": "perigee.bench.agreement",
    "multiturn": "perigee.bench.multiturn",
    "capacity": "perigee.bench.capacity",
    "capacity-ab": "perigee.bench.capacity_ab",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHES:
        print(f"usage: perigee bench {{{','.join(BENCHES)}}} [--json PATH]", file=sys.stderr)
        return 2
    return int(importlib.import_module(BENCHES[argv[0]]).main(argv[1:]) or 0)
