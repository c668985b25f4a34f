"""``perigee bench chaos``: a trace slice replayed while services are SIGKILLed.

Starts a supervised stack as ``perigee up`` runs it (``--nats-cluster 3``, two
conductors, 2 prefill + 2 decode nodes, the mock engine) and replays a slice of the
Mooncake trace through the gateway twice, in one invocation:

1. **quiet**: nothing is killed (the TTFT baseline);
2. **chaos**: the same slice (prompts built with another seed, so it reuses nothing the
   quiet run left in the stores), and every ``--fault-gap`` seconds (default: the
   slice's span over 7, so the six faults fall inside it), and not before the last
   killed service is back, one of decode-0, prefill-0, store-p1, conductor-0, admission
   and nats-server n1 gets a SIGKILL; the supervisor restarts each.

Reports, for the chaos run: **accepted requests lost** (HTTP 200, then the stream
broke off, carried an error event, or hung past ``--request-timeout``; target 0), the
requests that got an error before acceptance (status and message), and per fault its
**recovery**: kill -> the supervisor's restart, kill -> the service back (a worker's
next load report, a store's announce, a nats-server's /healthz; the others: their
restart), and kill -> the first request sent after the kill that completed. And the
**p99 TTFT cost**: chaos p99 TTFT against the quiet run's.
"""

import argparse
import asyncio
import json
import math
import signal
import threading
import time
import urllib.request
from dataclasses import dataclass

import aiohttp
import nats

from bus_schemas import subjects
from perigee import models
from perigee.bench.stats import percentile
from perigee.natsd import free_port
from perigee.replay import ReplayOutcome, send
from perigee.stack import Stack, StackConfig
from perigee.supervise import RestartPolicy, SupervisedEvent
from perigee.trace import DEFAULT_TRACE, PromptBuilder, TraceRequest, load_trace, spread_ties
from services.common import defaults
from services.common.model_spec import ModelSpec

# What each fault kills, in the order they come.
FAULTS = ("decode-0", "prefill-0", "store-p1", "conductor-0", "admission", "nats-n1")


@dataclass
class Sent:
    """One replayed request of the chaos bench: when it went, how it ended, whether it hung."""

    t_send: float  # perf_counter
    t_end: float
    outcome: ReplayOutcome
    hung: bool = False


def lost_reason(s: Sent) -> str:
    """Why an accepted request counts as lost ("" if it is not lost)."""
    o = s.outcome
    if s.hung:
        return "hung"
    if o.status != 200:
        return ""
    if o.error:
        return f"error event after acceptance: {o.error}"
    if not o.ok:
        return "stream ended without [DONE]"
    got = o.completion_tokens or o.tokens_seen
    if got < o.expected_tokens:
        return f"cut: {got} of {o.expected_tokens} tokens"
    return ""


async def replay_slice(
    reqs: list[TraceRequest], url: str, model: str, builder: PromptBuilder, a: argparse.Namespace
) -> list[Sent]:
    timeout = aiohttp.ClientTimeout(total=None, sock_read=a.request_timeout)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout
    ) as http:
        t0 = time.perf_counter()
        base = reqs[0].timestamp_s

        async def one(r: TraceRequest) -> Sent:
            delay = t0 + (r.timestamp_s - base) / a.trace_speedup - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            n_out = max(1, min(a.max_output, round(r.output_length * a.output_scale)))
            t = time.perf_counter()
            try:
                o = await asyncio.wait_for(
                    send(http, url, model, builder.tokens(r), n_out, {}), a.request_timeout
                )
                return Sent(t, time.perf_counter(), o)
            except TimeoutError:
                o = ReplayOutcome(ok=False, status=-1, expected_tokens=n_out, error="no answer")
                return Sent(t, time.perf_counter(), o, hung=True)

        return list(await asyncio.gather(*(one(r) for r in reqs)))


class Watch:
    """When each service showed it was back after its kill."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.events: list[tuple[float, SupervisedEvent]] = []
        self.back: dict[str, float] = {}
        self.armed: dict[str, float] = {}  # service -> kill time, waiting for its sign
        self.lock = threading.Lock()
        stack.on_supervised = self.on_event

    def on_event(self, e: SupervisedEvent) -> None:
        with self.lock:
            self.events.append((time.perf_counter(), e))

    def restarted_at(self, name: str, after: float) -> float:
        with self.lock:
            return next(
                (
                    t
                    for t, e in self.events
                    if e.name == name and e.kind == "restarted" and t >= after
                ),
                math.nan,
            )

    def seen(self, name: str) -> None:
        t = time.perf_counter()
        if name in self.armed and name not in self.back and t > self.armed[name]:
            self.back[name] = t

    def back_at(self, name: str, kill_t: float) -> float:
        """When ``name`` showed it was back (a conductor or admission: its restart)."""
        if name.startswith(("conductor", "admission")):
            return self.restarted_at(name, kill_t)
        return self.back.get(name, math.nan)

    async def start(self) -> None:
        async def quiet(e: Exception) -> None:  # its server's SIGKILL is expected here
            pass

        self.nc = await nats.connect(
            self.stack.nats_urls.split(","), error_cb=quiet, max_reconnect_attempts=-1
        )

        async def on_load(m) -> None:
            self.seen(m.subject.rsplit(".", 1)[-1])

        async def on_announce(m) -> None:
            try:
                node = json.loads(m.data).get("node", "")
            except ValueError:
                return
            self.seen(f"store-{node}")

        await self.nc.subscribe(subjects.LOAD_ALL, cb=on_load)
        await self.nc.subscribe(subjects.STORE_ANNOUNCE, cb=on_announce)
        await self.nc.flush()

    async def wait_nats(self, name: str, timeout: float) -> None:
        srv = self.stack.nats_servers()[name]
        url = f"http://127.0.0.1:{srv.monitor_port}/healthz"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:

                def ok() -> bool:
                    with urllib.request.urlopen(url, timeout=1) as r:
                        return r.status == 200

                if await asyncio.to_thread(ok):
                    self.back[name] = time.perf_counter()
                    return
            except OSError:
                pass
            await asyncio.sleep(0.1)

    async def close(self) -> None:
        await self.nc.close()


def kill(stack: Stack, name: str) -> None:
    if name.startswith("nats-"):
        stack.nats_servers()[name].kill()
    else:
        stack.kill(name, signal.SIGKILL)


async def inject(
    stack: Stack, watch: Watch, a: argparse.Namespace, kills: dict[str, float]
) -> None:
    """One fault every ``fault_gap`` s, each only once the one before is back (or
    ``request_timeout`` has passed), so that each recovery is seen on its own."""
    t = time.perf_counter()
    for name in FAULTS:
        await asyncio.sleep(max(0.0, t + a.fault_gap - time.perf_counter()))
        t = time.perf_counter()
        watch.armed[name] = t
        await asyncio.to_thread(kill, stack, name)
        kills[name] = t
        print(f"  SIGKILL {name}", flush=True)
        if name.startswith("nats-"):
            await watch.wait_nats(name, a.request_timeout)
        deadline = time.monotonic() + a.request_timeout
        while time.monotonic() < deadline and math.isnan(watch.back_at(name, t)):
            await asyncio.sleep(0.1)


def ttft_p99(sent: list[Sent]) -> float:
    return percentile(
        [
            s.outcome.ttft_s
            for s in sent
            if not lost_reason(s) and s.outcome.status == 200 and s.outcome.ok
        ],
        99,
    )


def report(
    quiet: list[Sent],
    chaos: list[Sent],
    kills: dict[str, float],
    watch: Watch,
    a: argparse.Namespace,
) -> dict:
    def after(s: Sent) -> str:
        """The last fault before the request ended: what it ran into."""
        return max(((t, n) for n, t in kills.items() if t <= s.t_end), default=(0, "none"))[1]

    lost = [
        {
            "reason": r,
            "status": s.outcome.status,
            "after_fault": after(s),
            "t_after_start_s": round(s.t_send - chaos[0].t_send, 3),
        }
        for s in chaos
        if (r := lost_reason(s))
    ]
    errors: dict[str, int] = {}
    errors_after: dict[str, dict[str, int]] = {}  # fault -> error -> count
    for s in chaos:
        o = s.outcome
        if o.status not in (200, -1):
            key = f"{o.status} {o.error.strip()[:160]}"
            errors[key] = errors.get(key, 0) + 1
            by = errors_after.setdefault(after(s), {})
            by[key] = by.get(key, 0) + 1
    recovery = []
    for name, t in kills.items():
        restart = watch.restarted_at(name, t)
        back = watch.back_at(name, t)
        after = [s.t_end for s in chaos if s.t_send >= t and s.outcome.ok and not lost_reason(s)]

        def ms(x: float, t: float = t) -> float | None:
            return None if x != x else round((x - t) * 1e3, 1)

        recovery.append(
            {
                "service": name,
                "restart_ms": ms(restart),
                "back_ms": ms(back),
                "first_completed_after_ms": ms(min(after)) if after else None,
            }
        )
    q, c = ttft_p99(quiet), ttft_p99(chaos)

    def slowest(n: int = 5) -> list[dict]:
        """Where the p99 goes: the slowest first tokens, each with the last fault killed
        before the request was sent (or while it waited) and how long after that kill."""
        done = [s for s in chaos if s.outcome.ok and not lost_reason(s) and s.outcome.ttft_s]
        out = []
        for s in sorted(done, key=lambda s: -s.outcome.ttft_s)[:n]:
            first = s.t_send + s.outcome.ttft_s
            t_kill, name = max(
                ((t, k) for k, t in kills.items() if t <= first), default=(math.nan, "none")
            )
            out.append(
                {
                    "ttft_ms": round(s.outcome.ttft_s * 1e3, 1),
                    "sent_after_start_s": round(s.t_send - chaos[0].t_send, 3),
                    "fault": name,
                    "sent_after_kill_ms": None
                    if t_kill != t_kill
                    else round((s.t_send - t_kill) * 1e3, 1),
                }
            )
        return out

    def count(sent: list[Sent]) -> dict:
        return {
            "requests": len(sent),
            "completed": sum(1 for s in sent if s.outcome.ok and not lost_reason(s)),
            "rejected_429": sum(1 for s in sent if s.outcome.status == 429),
            "other_errors": sum(1 for s in sent if s.outcome.status not in (200, 429, -1)),
        }

    return {
        "trace": a.trace,
        "start": a.start,
        "requests": a.requests,
        "trace_speedup": a.trace_speedup,
        "engine_speedup": a.speedup,
        "block_tokens": a.block_tokens,
        "output_scale": a.output_scale,
        "fault_gap_s": a.fault_gap,
        "faults": list(kills),
        "quiet": count(quiet),
        "chaos": count(chaos),
        "accepted_lost": len(lost),
        "lost": lost,
        "errors": errors,
        "errors_after_fault": errors_after,
        "recovery": recovery,
        "ttft_p99_ms": {
            "quiet": round(q * 1e3, 1),
            "chaos": round(c * 1e3, 1),
            "cost": round((c - q) * 1e3, 1),
            "ratio": round(c / q, 3) if q > 0 else None,
        },
        "slowest_ttft": slowest(),
        "restarts": {},
    }


async def run(stack: Stack, a: argparse.Namespace, vocab: int, model: str) -> dict:
    reqs = spread_ties(load_trace(a.trace, a.start + a.requests)[a.start :])
    if a.fault_gap is None:
        span = (reqs[-1].timestamp_s - reqs[0].timestamp_s) / a.trace_speedup
        a.fault_gap = span / (len(FAULTS) + 1)
    print(f"quiet run: {len(reqs)} requests", flush=True)
    quiet = await replay_slice(
        reqs, stack.url, model, PromptBuilder(a.block_tokens, vocab, seed=1), a
    )
    watch = Watch(stack)
    await watch.start()
    kills: dict[str, float] = {}
    print("chaos run", flush=True)
    try:
        chaos_task = asyncio.ensure_future(
            replay_slice(reqs, stack.url, model, PromptBuilder(a.block_tokens, vocab, seed=2), a)
        )
        await inject(stack, watch, a, kills)
        chaos = await chaos_task
    finally:
        await watch.close()
    out = report(quiet, chaos, kills, watch, a)
    out["restarts"] = stack.restarts
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="perigee bench chaos",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--trace", default=str(DEFAULT_TRACE))
    p.add_argument("--start", type=int, default=0, help="first trace request of the slice")
    p.add_argument("--requests", type=int, default=300, help="requests in the slice")
    p.add_argument(
        "--trace-speedup", type=float, default=1.0, help="divide trace timestamps by this"
    )
    p.add_argument("--speedup", default="10", help="mock engine speed against the paper's A800")
    p.add_argument(
        "--block-tokens",
        type=int,
        default=32,
        help="tokens per trace hash id (the trace's 512 scaled down)",
    )
    p.add_argument("--output-scale", type=float, default=1 / 16)
    p.add_argument("--max-output", type=int, default=64)
    p.add_argument(
        "--fault-gap",
        type=float,
        default=None,
        help="s between faults (default: the slice's span / 7)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=120.0,
        help="an accepted request unanswered this long counts as hung",
    )
    p.add_argument("--log-dir", default=".perigee/bench-logs/chaos")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    model = models.resolve(models.TINY_NAME)
    spec = ModelSpec.from_dir(model.path)
    cfg = StackConfig(
        port=free_port(),
        engine="mock",
        prefill=2,
        decode=2,
        conductors=2,
        nats_cluster=3,
        model_dir=str(model.path),
        served_model_name=model.name,
        block_size=defaults.BLOCK_SIZE,
        speedup=a.speedup,
        store_ssd_blocks=1024,
        log_dir=a.log_dir,
        log_level="WARNING",
        supervise=True,
        restart_policy=RestartPolicy(max_restarts=3, window_s=600.0, backoff_s=0.2),
    )
    with Stack(cfg) as stack:
        out = asyncio.run(run(stack, a, spec.vocab_size, model.name))
    c, t = out["chaos"], out["ttft_p99_ms"]
    print(
        f"chaos: {c['requests']} requests, {c['completed']} completed, "
        f"{c['rejected_429']} rejected (429), {c['other_errors']} other errors; "
        f"accepted requests lost: {out['accepted_lost']}"
    )
    for r in out["lost"]:
        print(f"  lost (after the {r['after_fault']} kill): {r['reason']}")
    for fault, errs in out["errors_after_fault"].items():
        for k, n in errs.items():
            print(f"  error x{n} (after the {fault} kill): {k}")
    for r in out["recovery"]:
        print(
            f"  {r['service']:<12} restart {r['restart_ms']} ms, back {r['back_ms']} ms, "
            f"first completion after {r['first_completed_after_ms']} ms"
        )
    print(f"  TTFT p99: quiet {t['quiet']} ms, chaos {t['chaos']} ms (cost {t['cost']} ms)")
    for w in out["slowest_ttft"]:
        print(
            f"  slow TTFT {w['ttft_ms']} ms: sent {w['sent_after_kill_ms']} ms after the "
            f"{w['fault']} kill"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0 if out["accepted_lost"] == 0 else 1
