"""``perigee bench capacity``: the highest request rate the live control plane holds.

The whole stack (nats-server, gateway, admission, conductor, 1 prefill + 1 decode
worker, two stores) with the mock engine at zero compute (``--speedup inf``), so that
a request's time to first token is all overhead: gateway -> admission -> conductor ->
prefill -> first token back through the gateway. Open-loop load rises step by step
(``--rates``, each step ``--step-s`` seconds of requests). A step is *answered* when no
request failed other than with a 429 (turning work away is an answer, not an error)
and the overhead p99 of the requests served is at most ``--p99-ms``; it is *held* when,
besides, at most ``--max-429-share`` of its requests got a 429. The highest rate of the
leading held steps is the result; the run goes on above it while steps are answered
(overload answered with 429s only) and stops at the first step that is not. Once per
stack layout (``--layouts``: conductors x admissions, e.g. ``1x1,2x2``).
The gateways' gates (services.gateway.lateness): ``--max-overhead-ms``
(``PERIGEE_MAX_OVERHEAD_MS``; unset: the gateways' default, on) judges the control
plane's overhead, net of the engine's part; ``--max-lateness-ms``
(``PERIGEE_MAX_LATENESS_MS``; off unless set) also a first token later than the
conductor's estimate.

Beside it, on the same nats-server and in the same run: NATS's own request/reply rate
(``--nats-clients`` requesters back to back against one responder for
``--nats-s`` seconds), what one bus hop can carry on this machine.

Beside that, also per layout (perigee.bench.bus_baseline): a paced NATS round trip
between two processes (``--paced-rate``, ``--paced-n``), measured before the first step
and after each, whose median is the unit each step's overhead is also given in, and its
CPU time; and the bus messages per request, counted while
``--count-requests`` requests run one after another.

Where the time goes: each step reports the CPU time every process spent during it
(``/proc/<pid>/stat``: each service, each nats-server, and this load generator, whose
HTTP client is a lean one, :mod:`perigee.bench.lean_http`), per request sent. A rate
is out of reach on this machine once the total, times the rate, is above its cores.
"""

import argparse
import asyncio
import json
import os
import statistics
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import nats

from perigee.bench import bus_baseline
from perigee.bench.lean_http import HttpError, LeanClient
from perigee.bench.stats import (
    cpu_seconds,
    machine,
    machine_line,
    outcomes,
    summary_ms,
    wakeups,
)
from perigee.natsd import free_port
from perigee.stack import Stack, StackConfig
from services.common import runner
from services.common.bus import sync
from tracing.sampler import DEFAULT_RATE as DEFAULT_TRACE_RATE

T = TypeVar("T")

DEFAULT_RATES = "25,50,100,150,200,300,400,600,800"


@dataclass
class Step:
    """One rate step of the capacity bench: what was sent and how it fared."""

    rate: float
    sent: int
    ok: int = 0
    rejected: int = 0  # 429
    errors: dict[str, int] = field(default_factory=dict)  # kind -> count
    overhead_s: list[float] = field(default_factory=list)
    cpu_s: dict[str, float] = field(default_factory=dict)  # process -> CPU s in the step
    wakes: dict[str, int] = field(default_factory=dict)  # process -> its threads' wake-ups

    def answered(self, p99_ms: float) -> bool:
        """No failure but 429s, and the served requests' overhead p99 within ``p99_ms``."""
        if self.errors or not self.overhead_s:
            return False
        return summary_ms(self.overhead_s)["p99"] <= p99_ms

    def held(self, p99_ms: float, max_429_share: float = 0.01) -> bool:
        """Answered, and served: at most ``max_429_share`` of the requests got a 429."""
        return self.answered(p99_ms) and self.rejected <= max_429_share * self.sent

    def report(self) -> dict:
        return {
            "rate_rps": self.rate,
            "sent": self.sent,
            "ok": self.ok,
            "rejected_429": self.rejected,
            "errors": dict(self.errors),
            "overhead_ms": summary_ms(self.overhead_s),
            "cpu_ms_per_request": self.cpu_per_request(),
            "wakes_per_request": self.wakes_per_request(),
        }

    def wakes_per_request(self) -> dict[str, float]:
        """How often each process slept and was woken, per request sent (with the CPU
        a request costs it: what one wake costs there), and their ``total``."""
        if not self.wakes:
            return {}
        out = {k: round(v / self.sent, 2) for k, v in sorted(self.wakes.items())}
        out["total"] = round(sum(self.wakes.values()) / self.sent, 2)
        return out

    def cpu_per_request(self) -> dict[str, float]:
        """CPU ms per request sent, by process, and their ``total``."""
        if not self.cpu_s:
            return {}
        out = {k: round(1e3 * v / self.sent, 3) for k, v in sorted(self.cpu_s.items())}
        out["total"] = round(1e3 * sum(self.cpu_s.values()) / self.sent, 3)
        return out


def stack_pids(stack: Stack) -> dict[str, int]:
    """Every process of the run: the services, the nats-servers, this load generator."""
    pids = {n: c.proc.pid for n, c in stack.children.items() if c.proc is not None}
    for n, srv in stack.nats_servers().items():
        if srv.proc is not None:
            pids[n] = srv.proc.pid
    pids["load-generator"] = os.getpid()
    return pids


def run_load(coro: Coroutine[Any, Any, T]) -> T:
    """Run the load generator's ``coro`` on the services' loop (uvloop where installed):
    it shares the cores with the stack it measures, so its own cost is kept low."""
    with asyncio.Runner(loop_factory=runner.loop_factory()) as r:
        return r.run(coro)


def measured_step(url: str, rate: float, seconds: float, pids: dict[str, int]) -> Step:
    """:func:`step`, with the CPU time each of ``pids`` spent meanwhile."""
    before = {n: cpu_seconds(p) for n, p in pids.items()}
    woke = {n: wakeups(p) for n, p in pids.items()}
    s = run_load(step(url, rate, seconds))
    s.cpu_s = {n: max(0.0, cpu_seconds(p) - before[n]) for n, p in pids.items()}
    s.wakes = {n: max(0, wakeups(p) - woke[n]) for n, p in pids.items()}
    return s


def held_rate(steps: list[Step], p99_ms: float, max_429_share: float = 0.01) -> float:
    """The highest rate of the run's leading steps that all held (0: none)."""
    best = 0.0
    for s in steps:
        if not s.held(p99_ms, max_429_share):
            break
        best = s.rate
    return best


async def one_request(client: LeanClient, i: int) -> tuple[str, float]:
    """(outcome, seconds to the first token): "ok", "429", or an error kind."""
    body = json.dumps(
        {"prompt": f"capacity {i}", "max_tokens": 2, "ignore_eos": True, "stream": True}
    ).encode()
    try:
        async with asyncio.timeout(60):
            r = await client.post("/v1/completions", body)
    except (TimeoutError, OSError, EOFError, ValueError, HttpError) as e:
        return type(e).__name__, float("nan")
    if r.status != 200:
        return str(r.status), r.first_s
    if not r.done:
        return "cut", r.first_s
    return ("ok" if r.first_s == r.first_s else "no token"), r.first_s


async def step(url: str, rate: float, seconds: float) -> Step:
    n = max(1, round(rate * seconds))
    out = Step(rate, n)
    async with LeanClient(url) as client:
        tasks = []
        start = time.perf_counter()
        for i in range(n):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one_request(client, i)))
        out.overhead_s, out.rejected, out.errors = outcomes(await asyncio.gather(*tasks))
    out.ok = len(out.overhead_s)
    return out


async def warm(url: str, n: int) -> None:
    async with LeanClient(url) as client:
        for i in range(n):
            await one_request(client, -1 - i)


async def count_messages(admin_url: str, url: str, n: int) -> dict:
    async with LeanClient(url) as client:
        return await bus_baseline.messages_per_request(
            admin_url, n, lambda i: one_request(client, i)
        )


async def nats_rate(url: str, clients: int, seconds: float) -> dict:
    """Request/reply round trips per second: ``clients`` requesters back to back."""
    server = await nats.connect(url)
    conns = [await nats.connect(url) for _ in range(clients)]

    async def echo(m) -> None:
        await m.respond(m.data)

    await server.subscribe("bench.capacity.echo", cb=echo)
    await sync(server)
    done = [0] * clients
    stop = time.perf_counter() + seconds

    async def run(k: int) -> None:
        nc = conns[k]
        while time.perf_counter() < stop:
            await nc.request("bench.capacity.echo", b"x" * 64, timeout=5)
            done[k] += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(run(k) for k in range(clients)))
    wall = time.perf_counter() - t0
    for nc in conns:
        await nc.close()
    await server.close()
    return {"clients": clients, "round_trips": sum(done), "per_s": round(sum(done) / wall, 1)}


def in_rtts(report: dict, rtt_ms: float) -> str:
    """A step's overhead p50 / p99 in paced NATS round trips."""
    o = report["overhead_ms"]
    if not rtt_ms or not o or o["p50"] != o["p50"]:  # nothing served: NaN
        return "-"
    return f"{o['p50'] / rtt_ms:.1f} / {o['p99'] / rtt_ms:.1f}"


def parse_layouts(text: str) -> list[tuple[int, int]]:
    """``"1x1,2x2"`` -> [(1, 1), (2, 2)]: conductors x admissions."""
    out = []
    for part in text.split(","):
        c, sep, a = part.strip().partition("x")
        if not sep or not c.isdigit() or not a.isdigit() or int(c) < 1 or int(a) < 1:
            raise ValueError(f"a layout is CONDUCTORSxADMISSIONS (e.g. 2x2), not {part!r}")
        out.append((int(c), int(a)))
    return out


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise ValueError(f"--rates takes numbers separated by commas, not {text!r}") from None
    if not rates or min(rates) <= 0 or rates != sorted(rates):
        raise ValueError("--rates must be positive and rising")
    return rates


def run_layout(conductors: int, admissions: int, a: argparse.Namespace, rates: list[float]) -> dict:
    cfg = StackConfig(
        port=free_port(),
        speedup="inf",
        conductors=conductors,
        admissions=admissions,
        log_dir=f"{a.log_dir}/{conductors}x{admissions}",
        log_level="WARNING",
        trace_sample=a.trace_sample,
        trace_rate=a.trace_rate,
        nats_procs=a.nats_procs,
        durable_intake=a.durable_intake,
        extra_env=gate_env(a),
    )
    steps: list[Step] = []
    with Stack(cfg) as stack:
        bus = asyncio.run(nats_rate(stack.nats_url, a.nats_clients, a.nats_s))
        run_load(warm(stack.url, a.warmup))
        pids = stack_pids(stack)
        server_pid = next((p for n, p in pids.items() if n.startswith("nats")), None)

        def paced_rtt() -> dict:
            return asyncio.run(
                bus_baseline.paced_round_trip(stack.nats_url, server_pid, a.paced_rate, a.paced_n)
            )

        paced = paced_rtt()
        rtts = [paced["latency_ms"]["p50"]]
        hops = asyncio.run(count_messages(stack.nats_url, stack.url, a.count_requests))
        print(
            f"  paced NATS round trip ({a.paced_rate:g}/s): p50 {rtts[0]} ms, "
            f"CPU {paced['cpu_us']['total']:g} us all told; "
            f"bus messages per request: {hops['per_request']:g}",
            flush=True,
        )
        for rate in rates:
            s = measured_step(stack.url, rate, a.step_s, pids)
            steps.append(s)
            # The unit is measured again after each step: on a shared machine one
            # measurement of it varied from 0.44 to 0.84 ms between runs.
            rtts.append(paced_rtt()["latency_ms"]["p50"])
            r = s.report()
            print(
                f"  {conductors}x{admissions} {rate:g} req/s: ok {s.ok}/{s.sent}, 429 {s.rejected}, "
                f"errors {r['errors'] or 0}, overhead p50 {r['overhead_ms']['p50']} ms "
                f"p99 {r['overhead_ms']['p99']} ms, CPU {r['cpu_ms_per_request']['total']} "
                f"ms/request; paced round trip after it {rtts[-1]} ms"
                + (
                    ""
                    if s.held(a.p99_ms, a.max_429_share)
                    else "  (answered, 429s)"
                    if s.answered(a.p99_ms)
                    else "  (not answered)"
                ),
                flush=True,
            )
            cpu, wakes = r["cpu_ms_per_request"], r["wakes_per_request"]
            print(
                "    CPU ms/request: "
                + ", ".join(f"{n} {v:g}" for n, v in cpu.items() if n != "total"),
                flush=True,
            )
            print(
                "    wake-ups/request: " + ", ".join(f"{n} {v:g}" for n, v in wakes.items()),
                flush=True,
            )
            if not s.answered(a.p99_ms):
                break
        rtt_ms = round(statistics.median(rtts), 3)
        print(
            f"  overhead p50 / p99 in paced round trips of {rtt_ms} ms (the median of "
            f"{len(rtts)}, {min(rtts)}-{max(rtts)} ms): "
            + ", ".join(f"{s.rate:g} req/s {in_rtts(s.report(), rtt_ms)}" for s in steps),
            flush=True,
        )
    return {
        "conductors": conductors,
        "admissions": admissions,
        "held_rps": held_rate(steps, a.p99_ms, a.max_429_share),
        # Every step run above the held rate answered with 429s only, in time.
        "answered_rps": max((s.rate for s in steps if s.answered(a.p99_ms)), default=0.0),
        "max_lateness_ms": a.max_lateness_ms,
        "max_overhead_ms": a.max_overhead_ms,
        "nats_request_reply": bus,
        "paced_round_trip": paced,
        # The unit of overhead_rtts: the median of the paced p50s before and after each step.
        "paced_p50s_ms": rtts,
        "round_trip_unit_ms": rtt_ms,
        "bus_messages": hops,
        "steps": [{**s.report(), "overhead_rtts": in_rtts(s.report(), rtt_ms)} for s in steps],
    }


def gate_env(a: argparse.Namespace) -> dict[str, str]:
    """The gateways' gates as the bench's flags set them (unset: the gateways' own)."""
    env = {"PERIGEE_MAX_LATENESS_MS": f"{a.max_lateness_ms:g}"} if a.max_lateness_ms else {}
    if a.max_overhead_ms is not None:
        env["PERIGEE_MAX_OVERHEAD_MS"] = f"{a.max_overhead_ms:g}"
    return env


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="perigee bench capacity",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--rates", default=DEFAULT_RATES, help="rising request rates, req/s")
    p.add_argument("--step-s", type=float, default=4.0, help="seconds of requests per rate")
    p.add_argument("--p99-ms", type=float, default=50.0, help="overhead p99 a held rate keeps")
    p.add_argument(
        "--max-429-share",
        type=float,
        default=0.01,
        help="share of a step's requests that may get a 429 for the step to be held",
    )
    p.add_argument(
        "--max-lateness-ms",
        type=float,
        default=0.0,
        help="the gateways' --max-lateness-ms (0: the gate off, their default)",
    )
    p.add_argument(
        "--max-overhead-ms",
        type=float,
        default=None,
        help="the gateways' --max-overhead-ms (0: that gate off; default: theirs)",
    )
    p.add_argument("--layouts", default="1x1,2x2", help="conductors x admissions, comma list")
    p.add_argument(
        "--trace-sample",
        type=float,
        default=1.0,
        help="share of requests traced (perigee up --trace-sample; default: every one "
        "up to --trace-rate)",
    )
    p.add_argument(
        "--trace-rate",
        type=float,
        default=DEFAULT_TRACE_RATE,
        help="new traces a second at each gateway at most (perigee up --trace-rate; "
        "0: every request; default: %(default)s)",
    )
    p.add_argument(
        "--nats-procs",
        type=int,
        default=None,
        help="the nats-server's GOMAXPROCS (perigee up --nats-procs; default: automatic)",
    )
    p.add_argument(
        "--durable-intake",
        action="store_true",
        help="requests on the JetStream work queues (perigee up --durable-intake)",
    )
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--nats-clients", type=int, default=8)
    p.add_argument("--nats-s", type=float, default=3.0)
    p.add_argument(
        "--paced-rate", type=float, default=50.0, help="round trips/s of the paced baseline"
    )
    p.add_argument("--paced-n", type=int, default=200, help="round trips of the paced baseline")
    p.add_argument(
        "--count-requests", type=int, default=50, help="requests whose bus messages are counted"
    )
    p.add_argument("--log-dir", default=".perigee/bench-logs/capacity")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    try:
        rates, layouts = parse_rates(a.rates), parse_layouts(a.layouts)
    except ValueError as e:
        p.error(str(e))
    results = []
    host = machine()
    print(f"on {machine_line(host)}", flush=True)
    for conductors, admissions in layouts:
        print(f"{conductors} conductor(s), {admissions} admission(s):", flush=True)
        res = run_layout(conductors, admissions, a, rates)
        results.append(res)
        print(
            f"  held {res['held_rps']:g} req/s (overhead p99 <= {a.p99_ms:g} ms, no error, "
            f"429s <= {a.max_429_share:g}); answered with 429s only up to "
            f"{res['answered_rps']:g} req/s; NATS request/reply on the same server: {res['nats_request_reply']['per_s']:g}/s",
            flush=True,
        )
    out = {
        "machine": host,
        "p99_ms": a.p99_ms,
        "step_s": a.step_s,
        "trace_sample": a.trace_sample,
        "trace_rate": a.trace_rate,
        "nats_procs": a.nats_procs,
        "durable_intake": a.durable_intake,
        "layouts": results,
    }
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0
