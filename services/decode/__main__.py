"""``python -m services.decode``: one decode instance bound to its node's store (see
:mod:`services.worker.main` for the arguments)."""

import argparse
import sys

from bus_schemas.roles import Role
from services.common import runner
from services.decode.worker import build_decode
from services.prefill.worker import build_prefill
from services.worker import main as worker_main

# Each role's package builds its worker; a switchable process serves both roles.
BUILDERS = {Role.PREFILL: build_prefill, Role.DECODE: build_decode}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return worker_main.parse_args(Role.DECODE, "d0", __doc__, argv)


def main(argv: list[str] | None = None) -> int:
    return runner.run(worker_main.run(Role.DECODE, parse_args(argv), BUILDERS))


if __name__ == "__main__":
    sys.exit(main())
