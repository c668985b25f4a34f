"""The flags several services take, declared once: the stack's TTFT and TBT SLOs and
how long an instance may stay silent before it counts as dead. Their values live in
services.common.defaults; each service says in ``use`` what it does with them."""

import argparse

from services.common import defaults


def add_slos(p: argparse.ArgumentParser, use: str = "", *, ttft: bool = True) -> None:
    """``--ttft-slo`` (unless ``ttft`` is False) and ``--tbt-slo``, seconds."""
    tail = f": {use}" if use else ""
    if ttft:
        p.add_argument(
            "--ttft-slo", type=float, default=defaults.TTFT_SLO_S, help=f"TTFT SLO, s{tail}"
        )
    p.add_argument("--tbt-slo", type=float, default=defaults.TBT_SLO_S, help=f"TBT SLO, s{tail}")


def add_dead_after(p: argparse.ArgumentParser, use: str = "") -> None:
    """``--dead-after``, seconds."""
    p.add_argument(
        "--dead-after",
        type=float,
        default=defaults.DEAD_AFTER_S,
        help="seconds without a load report before an instance counts as dead"
        + (f" ({use})" if use else ""),
    )
