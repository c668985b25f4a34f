"""``perigee bench capacity-ab --against TREE``: this tree's control plane against
another revision's, step by step on one machine.

On a shared 2-core VM the machine's speed drifts by 30-50 % within minutes (the paced
NATS round trip went from 0.42 to 0.90 ms in one session), more than most single cuts
move a figure, so runs of one tree after the other compare phases as much as trees.
Here both stacks are up at once (each its own nats-server, services and stores; the
other tree's services run from ``--against``, with the flags this tree's stack gives
them), and each rate of :mod:`perigee.bench.capacity` is measured on one stack, then on
the other, the order alternating from step to step and round to round. The stack not
being measured idles (load reports, heartbeats). The result is each step's pair and, per
rate, each tree's median over the rounds.

The other tree must accept this tree's service flags (a revision near this one); make a
worktree of it first: ``git worktree add /tmp/base <rev>``.
"""

import argparse
import asyncio
import json
import os
import statistics

from perigee.bench import bus_baseline
from perigee.bench.capacity import Step, measured_step, parse_rates, stack_pids, warm
from perigee.natsd import free_port
from perigee.stack import Stack, StackConfig

SIDES = ("this", "against")


def order(round_: int, step: int) -> tuple[str, str]:
    """Which stack a step measures first: alternating from step to step, and between
    rounds, so that neither always runs right after the other's load."""
    return SIDES if (round_ + step) % 2 == 0 else SIDES[::-1]


def medians(steps: dict[str, list[Step]], rates: list[float]) -> dict[str, list[dict]]:
    """Per side and rate: the median over the rounds of the overhead p50 and p99 and of
    the CPU a request, and how many of the rounds' requests failed other than with 429."""
    out: dict[str, list[dict]] = {}
    for side, ss in steps.items():
        rows = []
        for rate in rates:
            at = [s.report() for s in ss if s.rate == rate]
            if not at:
                continue
            rows.append(
                {
                    "rate_rps": rate,
                    "rounds": len(at),
                    "p50_ms": statistics.median(r["overhead_ms"]["p50"] for r in at),
                    "p99_ms": statistics.median(r["overhead_ms"]["p99"] for r in at),
                    "cpu_ms_per_request": statistics.median(
                        r["cpu_ms_per_request"]["total"] for r in at
                    ),
                    "errors": sum(sum(r["errors"].values()) for r in at),
                    "rejected_429": sum(r["rejected_429"] for r in at),
                }
            )
        out[side] = rows
    return out


def _config(a: argparse.Namespace, side: str) -> StackConfig:
    return StackConfig(
        port=free_port(),
        speedup="inf",
        log_dir=f"{a.log_dir}/{side}",
        log_level="WARNING",
        trace_sample=a.trace_sample,
        code_root="" if side == "this" else a.against,
    )


def run(a: argparse.Namespace, rates: list[float]) -> dict:
    steps: dict[str, list[Step]] = {s: [] for s in SIDES}
    with Stack(_config(a, "this")) as this, Stack(_config(a, "against")) as other:
        stacks = {"this": this, "against": other}
        for st in stacks.values():
            asyncio.run(warm(st.url, a.warmup))
        pids = {side: stack_pids(st) for side, st in stacks.items()}
        server = next(p for n, p in pids["this"].items() if n.startswith("nats"))
        paced = asyncio.run(bus_baseline.paced_round_trip(this.nats_url, server, 50.0, 200))
        print(f"  paced NATS round trip (50/s): p50 {paced['latency_ms']['p50']} ms", flush=True)
        for r in range(a.rounds):
            for i, rate in enumerate(rates):
                for side in order(r, i):
                    s = measured_step(stacks[side].url, rate, a.step_s, pids[side])
                    steps[side].append(s)
                    rep = s.report()
                    print(
                        f"  round {r + 1} {rate:g} req/s {side}: ok {s.ok}/{s.sent}, "
                        f"429 {s.rejected}, errors {rep['errors'] or 0}, overhead p50 "
                        f"{rep['overhead_ms']['p50']} ms p99 {rep['overhead_ms']['p99']} ms, "
                        f"CPU {rep['cpu_ms_per_request']['total']} ms/request",
                        flush=True,
                    )
    return {
        "against": a.against,
        "paced_round_trip": paced,
        "medians": medians(steps, rates),
        "steps": {side: [s.report() for s in ss] for side, ss in steps.items()},
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="perigee bench capacity-ab",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--against", required=True, help="the other revision's tree (a worktree)")
    p.add_argument("--rates", default="50,100,200", help="request rates, req/s")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--step-s", type=float, default=4.0, help="seconds of requests per step")
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument(
        "--trace-sample", type=float, default=1.0, help="perigee up --trace-sample, both"
    )
    p.add_argument("--log-dir", default=".perigee/bench-logs/capacity-ab")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if not os.path.isdir(os.path.join(a.against, "services")):
        p.error(f"--against {a.against}: not a perigee tree (no services/ there)")
    if a.rounds < 1:
        p.error("--rounds must be at least 1")
    try:
        rates = parse_rates(a.rates)
    except ValueError as e:
        p.error(str(e))
    res = run(a, rates)
    print("  median over the rounds (p50 / p99 overhead, CPU a request):", flush=True)
    for rate in rates:
        cells = []
        for side in SIDES:
            rows = [m for m in res["medians"][side] if m["rate_rps"] == rate]
            if rows:
                m = rows[0]
                cells.append(
                    f"{side} {m['p50_ms']:.2f} / {m['p99_ms']:.2f} ms, "
                    f"{m['cpu_ms_per_request']:.2f} ms"
                    + (f", {m['errors']} errors" if m["errors"] else "")
                )
        print(f"  {rate:g} req/s: " + "; ".join(cells), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0
