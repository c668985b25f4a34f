"""What one bus hop costs on this machine, and how many hops a request makes: the
baselines ``perigee bench capacity`` measures beside the stack, on the same server.

- :func:`paced_round_trip`: core NATS request/reply between two processes at a steady,
  low rate, so that both sides sleep between round trips as the services do between
  requests. Its latency is the unit of issue 27's overhead target (a request's first
  token within so many paced round trips), and its CPU time (requester, responder and
  nats-server together) what one hop costs here when nothing batches: a request's bus
  messages times half of it is the floor under the stack's CPU per request.
- :func:`messages_per_request`: every message on the bus (the admin login sees them
  all) while requests are sent one after another, counted by subject.
"""

import asyncio
import collections
import os
import re
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import nats

from perigee.bench.stats import cpu_seconds, summary_ms
from services.common.bus import sync

SUBJECT = "bench.capacity.paced"

# The responder runs on the loop the services run on (uvloop where installed).
RESPONDER = """
import asyncio, sys
import nats
from services.common import runner

async def main():
    nc = await nats.connect(sys.argv[1])
    async def echo(m):
        await m.respond(m.data)
    await nc.subscribe(sys.argv[2], cb=echo)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.Event().wait()

runner.run(main())
"""


async def paced_round_trip(url: str, server_pid: int | None, rate: float, n: int) -> dict:
    """``n`` request/replies ``1/rate`` s apart, to a responder in its own process:
    latency (ms) and CPU per round trip (µs) of each side and the server."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    responder = subprocess.Popen(
        [sys.executable, "-c", RESPONDER, url, SUBJECT],
        stdout=subprocess.PIPE,
        env=env,
    )
    try:
        assert responder.stdout is not None
        ready = await asyncio.to_thread(responder.stdout.readline)
        if ready.strip() != b"ready":
            raise RuntimeError("the paced round trip's responder did not start")
        nc = await nats.connect(url)
        try:
            for _ in range(20):  # connections and caches warm
                await nc.request(SUBJECT, b"x" * 200, timeout=5)
            pids = {"requester": os.getpid(), "responder": responder.pid}
            if server_pid is not None:
                pids["nats-server"] = server_pid
            before = {k: cpu_seconds(p) for k, p in pids.items()}
            lat: list[float] = []
            t0 = time.perf_counter()
            for i in range(n):
                delay = t0 + i / rate - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                s = time.perf_counter()
                await nc.request(SUBJECT, b"x" * 200, timeout=5)
                lat.append(time.perf_counter() - s)
            cpu = {k: round(1e6 * (cpu_seconds(p) - before[k]) / n, 1) for k, p in pids.items()}
        finally:
            await nc.close()
    finally:
        responder.kill()
        responder.wait()
    cpu["total"] = round(sum(cpu.values()), 1)
    return {"rate": rate, "round_trips": n, "latency_ms": summary_ms(lat), "cpu_us": cpu}


def subject_kind(subject: str) -> str:
    """A subject with its ids folded, so that every request's messages count together."""
    if subject.startswith("_INBOX."):
        return "_INBOX (replies)"
    if subject.startswith("$JS.ACK."):
        return ".".join(subject.split(".")[:4]) + " (acks)"
    s = re.sub(r"\.cmpl-.*$", ".<request>", subject)
    s = re.sub(r"\.reserved\.[0-9a-f]{16}\.", ".reserved.<key>.", s)  # reserved ahead
    return re.sub(r"\.[0-9a-f]{32}$", ".<claim>", s)


async def messages_per_request(
    admin_url: str, n: int, send: Callable[[int], Awaitable[object]]
) -> dict:
    """Bus messages per request while ``n`` requests (``send(i)``) run one after another."""
    counts: collections.Counter[str] = collections.Counter()
    nc = await nats.connect(admin_url)
    try:

        async def count(m) -> None:
            counts[subject_kind(m.subject)] += 1

        sub = await nc.subscribe(">", cb=count)
        await sync(nc)
        counts.clear()  # what the subscription's own set-up sent
        for i in range(n):
            await send(1_000_000 + i)
        await sync(nc)
        await asyncio.sleep(0.5)  # notices and commits that follow a request's end
        await sub.unsubscribe()
    finally:
        await nc.close()
    by_subject = {k: round(v / n, 2) for k, v in counts.most_common()}
    return {
        "requests": n,
        "per_request": round(sum(counts.values()) / n, 2),
        "by_subject": by_subject,
    }
