"""Measure what the live stack adds to the cost model, for the simulator's ``LIVE_*``
constants (perigee/sim/simulator.py) that :func:`perigee.sim.simulate_slice` uses.

Starts a local stack (mock engine) in the live-vs-sim configuration of
tests/e2e/test_live_vs_sim.py, replays the same trace slice with a client that stamps
wall-clock send and first-token times, reads the stack's spans and prints, per stage,
the p10/p50/p90 over the requests (ms):

    in          client send -> gateway.request start (HTTP)
    to_queue    gateway.request start -> prefill.queue start: admission, conductor
                placement, the TxAllocate round trip, the PrefillTask hop
    overrun     prefill.compute span - cost.prefill_time (the mock's pacing)
    tail        prefill.compute end -> the client has the first token
    handoff     on one prefill instance, compute end -> next compute start when the
                next task was already queued (last layers' acks, DecodeTask and
                FirstTokenNotice publishes, the queue runner)

and the constants they give: dispatch = in + to_queue, first-token hop = overrun +
tail, prefill handoff = overrun + handoff (medians).

    .venv/bin/python scripts/measure_live_overheads.py [--runs 3] [--speed 2]
"""

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perigee.breakdown import by_trace, read_spans  # noqa: E402
from perigee.natsd import free_port  # noqa: E402
from perigee.stack import Stack, StackConfig  # noqa: E402
from perigee.trace import PromptBuilder, load_trace, spread_ties  # noqa: E402
from services.common.cost_model import CostModel  # noqa: E402


async def _send(http, url: str, prompt: list[int], max_tokens: int) -> tuple[int, int]:
    body = {
        "model": "tiny-llama",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
    }
    sent, first = time.time_ns(), 0
    async with http.post(url + "/v1/completions", json=body) as r:
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            obj = json.loads(line[5:])
            if not first and obj.get("choices") and obj["choices"][0].get("text") is not None:
                first = time.time_ns()
    return sent, first


async def _replay(trace, url: str, speed: float, builder: PromptBuilder, output_scale: float):
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        t0, base = time.perf_counter(), trace[0].timestamp_s

        async def one(r):
            delay = t0 + (r.timestamp_s - base) / speed - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            n_out = max(1, round(r.output_length * output_scale))
            return await _send(http, url, builder.tokens(r), n_out)

        return await asyncio.gather(*(one(r) for r in trace))


def measure(a) -> dict[str, list[float]]:
    trace = spread_ties(load_trace(limit=a.slice))
    builder = PromptBuilder(a.block, 1024)
    cost = CostModel().with_speedup(a.speedup)
    log_dir = tempfile.mkdtemp(prefix="perigee-overheads-")
    stack = Stack(
        StackConfig(
            port=free_port(),
            log_dir=log_dir,
            engine="mock",
            prefill=a.prefill,
            decode=a.decode,
            speedup=str(a.speedup),
            block_size=a.block,
            store_capacity_blocks=a.capacity_blocks,
        )
    )
    stack.start()
    try:
        stamps = asyncio.run(_replay(trace, stack.url, a.speed, builder, a.output_scale))
    finally:
        stack.stop()
    roots = []
    for spans in by_trace(read_spans(os.path.join(log_dir, "spans.jsonl"))).values():
        named = {s["name"]: s for s in sorted(spans, key=lambda s: -s["start_ns"])}
        if {"gateway.request", "prefill.queue", "prefill.compute"} <= named.keys():
            roots.append(named)
    roots.sort(key=lambda n: n["gateway.request"]["start_ns"])  # arrivals are spread: trace order
    if len(roots) != len(trace):
        raise SystemExit(f"{len(roots)} complete traces for {len(trace)} requests")
    out: dict[str, list[float]] = {k: [] for k in ("in", "to_queue", "overrun", "tail", "handoff")}
    for (sent, first), r, n in zip(stamps, trace, roots, strict=True):
        gw, q, c = n["gateway.request"], n["prefill.queue"], n["prefill.compute"]
        tokens = builder.input_length(r)
        prefix = int(c.get("attributes", {}).get("prefix_tokens", 0))
        out["in"].append((gw["start_ns"] - sent) / 1e9)
        out["to_queue"].append((q["start_ns"] - gw["start_ns"]) / 1e9)
        out["overrun"].append(
            (c["end_ns"] - c["start_ns"]) / 1e9 - cost.prefill_time(tokens, min(prefix, tokens - 1))
        )
        out["tail"].append((first - c["end_ns"]) / 1e9)
    by_instance: dict[str, list[dict]] = {}
    for n in roots:
        by_instance.setdefault(n["prefill.compute"].get("service") or "", []).append(n)
    for items in by_instance.values():
        items.sort(key=lambda n: n["prefill.compute"]["start_ns"])
        for prev, nxt in zip(items, items[1:], strict=False):
            if nxt["prefill.queue"]["start_ns"] < prev["prefill.compute"]["end_ns"]:
                out["handoff"].append(
                    (nxt["prefill.compute"]["start_ns"] - prev["prefill.compute"]["end_ns"]) / 1e9
                )
    return out


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--slice", type=int, default=80, help="first N trace requests")
    p.add_argument("--speed", type=float, default=2.0, help="replay speed (timestamps / X)")
    p.add_argument("--speedup", type=float, default=0.125, help="mock engine cost-model speedup")
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--capacity-blocks", type=int, default=4096)
    p.add_argument("--output-scale", type=float, default=0.02)
    a = p.parse_args()
    medians: dict[str, list[float]] = {}
    for i in range(a.runs):
        got = measure(a)
        print(f"run {i + 1}:")
        for k, v in got.items():
            if not v:
                continue
            v = sorted(v)
            med = statistics.median(v)
            medians.setdefault(k, []).append(med)
            print(
                f"  {k:9s} n={len(v):3d} p10 {v[len(v) // 10] * 1e3:6.2f} p50 {med * 1e3:6.2f} "
                f"p90 {v[9 * len(v) // 10] * 1e3:6.2f} ms"
            )
    m = {k: statistics.median(v) for k, v in medians.items()}
    print("median of run medians (ms): " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in m.items()))
    print(
        f"dispatch_s {m['in'] + m['to_queue']:.4f}  first_token_hop_s "
        f"{m['overrun'] + m['tail']:.4f}  prefill_handoff_s "
        f"{m['overrun'] + m.get('handoff', 0.0):.4f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
