"""``perigee bench pipeline``: the stack's own overhead.

Starts the whole stack with the mock engine at zero compute (``--speedup inf``),
sends short streaming completions open-loop at a steady rate through the HTTP
gateway, and measures full-path TTFT (request sent -> first SSE token chunk). In the
same run it measures a bare NATS request/reply round trip on the same server: the
floor any bus hop pays. Both as p50/p99; the ratio says how many bus round trips
the full path costs.

The round trip is measured twice: back to back (``nats_rtt_ms``, every process hot)
and paced at the request rate (``nats_rtt_paced_ms``), so that, like each request
of the open-loop load, it wakes processes that slept since the previous one. On a
small VM that wake-up, not the bus, is most of a hop's cost.

Each request ends served, turned away with a 429 (overload answered before acceptance:
not a failure), or failed, by kind (``errors``). The exit status is 1 when any failed.
"""

import argparse
import asyncio
import json
import time

import aiohttp
import nats

from perigee.bench.stats import machine, machine_line, outcomes, summary_ms
from perigee.natsd import free_port
from perigee.stack import Stack, StackConfig
from services.common.bus import sync


async def nats_rtt(url: str, n: int, rate: float = 0.0) -> list[float]:
    """``n`` bare request/reply round trips; ``rate`` > 0 paces them (per second)."""
    server = await nats.connect(url)
    client = await nats.connect(url)

    async def echo(m):
        await m.respond(m.data)

    await server.subscribe("bench.echo", cb=echo)
    await sync(server)
    out = []
    for _ in range(n):
        if rate > 0:
            await asyncio.sleep(1.0 / rate)
        t0 = time.perf_counter()
        await client.request("bench.echo", b"x" * 64, timeout=5)
        out.append(time.perf_counter() - t0)
    await client.close()
    await server.close()
    return out


async def one_request(http: aiohttp.ClientSession, url: str, i: int) -> tuple[str, float]:
    """(outcome, seconds to the first token): "ok", "429" (turned away before
    acceptance: an answer, not a failure), another HTTP status, "cut" (the stream ended
    without ``[DONE]``), or the exception's kind."""
    body = {
        "prompt": f"bench request {i}: hello",
        "max_tokens": 2,
        "ignore_eos": True,
        "stream": True,
    }
    t0 = time.perf_counter()
    ttft = None
    try:
        async with asyncio.timeout(60), http.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                await r.read()
                return str(r.status), float("nan")
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                if ttft is None and b'"text"' in line:
                    ttft = time.perf_counter() - t0
                if line == b"data: [DONE]":
                    return ("no token", float("nan")) if ttft is None else ("ok", ttft)
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        return type(e).__name__, float("nan")
    return "cut", float("nan")


async def drive(
    url: str, n: int, rate: float, warmup: int
) -> tuple[list[float], int, dict[str, int]]:
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as http:
        for i in range(warmup):
            await one_request(http, url, -i - 1)
        tasks = []
        start = time.perf_counter()
        for i in range(n):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one_request(http, url, i)))
        return outcomes(await asyncio.gather(*tasks))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="perigee bench pipeline", description=__doc__)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--rate", type=float, default=50.0, help="requests per second (open loop)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--rtt-samples", type=int, default=2000)
    p.add_argument(
        "--paced-rtt-samples", type=int, default=200, help="round trips paced at --rate (0: skip)"
    )
    p.add_argument("--log-dir", default=".perigee/bench-logs")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)

    cfg = StackConfig(port=free_port(), speedup="inf", log_dir=a.log_dir, log_level="WARNING")
    with Stack(cfg) as stack:
        rtt = asyncio.run(nats_rtt(stack.nats_url, a.rtt_samples))
        paced = (
            asyncio.run(nats_rtt(stack.nats_url, a.paced_rtt_samples, a.rate))
            if a.paced_rtt_samples
            else []
        )
        ttfts, rejected, errors = asyncio.run(drive(stack.url, a.requests, a.rate, a.warmup))
    failed = sum(errors.values())
    result = {
        "machine": machine(),
        "requests": a.requests,
        "rate_rps": a.rate,
        # Neither served nor turned away with a 429 (which answers overload, as it should).
        "failed": failed,
        "errors": errors,
        "rejected_429": rejected,
        "ttft_ms": summary_ms(ttfts),
        "nats_rtt_ms": summary_ms(rtt),
    }
    result["ttft_over_nats_rtt_p50"] = round(
        result["ttft_ms"]["p50"] / result["nats_rtt_ms"]["p50"], 2
    )
    if paced:
        result["nats_rtt_paced_ms"] = summary_ms(paced)
        result["ttft_over_paced_rtt_p50"] = round(
            result["ttft_ms"]["p50"] / result["nats_rtt_paced_ms"]["p50"], 2
        )
    print(f"on {machine_line(result['machine'])}")
    print(
        f"full-path TTFT  p50 {result['ttft_ms']['p50']:.3f} ms  p99 {result['ttft_ms']['p99']:.3f} ms"
        f"  ({a.requests} requests at {a.rate:g}/s: {len(ttfts)} served, {rejected} turned "
        f"away with 429, {failed} failed{' ' + str(errors) if errors else ''})"
    )
    print(
        f"NATS req/reply  p50 {result['nats_rtt_ms']['p50']:.3f} ms  p99 {result['nats_rtt_ms']['p99']:.3f} ms"
    )
    if paced:
        print(
            f"NATS req/reply paced at {a.rate:g}/s  p50 {result['nats_rtt_paced_ms']['p50']:.3f} ms"
            f"  p99 {result['nats_rtt_paced_ms']['p99']:.3f} ms"
        )
    print(
        f"TTFT / NATS RTT (p50): {result['ttft_over_nats_rtt_p50']}x"
        + (f"; / paced RTT: {result['ttft_over_paced_rtt_p50']}x" if paced else "")
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if failed == 0 else 1
