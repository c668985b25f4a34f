"""Live TTFT of long prompts with and without chunked pipeline parallelism (issue 16
item 3), on the mock engine: one stack per group size X, each with the same prefill
instances (``--prefill``), one decode instance, and the simulator's estimate beside.

    .venv/bin/python scripts/cpp_live_ttft.py [--groups 1 2] [--tokens 6000] [--runs 3]

Each run sends a fresh prompt (no cached prefix) alone and times the first streamed
token (TTFT) at the client. The estimate is the conductor's prior model through
services.policy.chunk_timing.pipeline_timing (X = 1: one instance's chunked prefill).
"""

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import nats

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bus_schemas import subjects
from bus_schemas.codec import decode  # noqa: E402
from bus_schemas.load import WorkerStats  # noqa: E402
from perigee.natsd import free_port  # noqa: E402
from perigee.stack import Stack, StackConfig  # noqa: E402
from services.common.cost_model import CostModel  # noqa: E402
from services.policy import chunk_timing


async def ttft(url: str, ids: list[int]) -> tuple[float, bool]:
    body = {"prompt": ids, "max_tokens": 2, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    first = None
    async with aiohttp.ClientSession() as http, http.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            return -1.0, False
        async for raw in r.content:
            line = raw.decode().strip()
            if line.startswith("data:") and first is None and "error" not in line:
                first = time.perf_counter() - t0
            if line == "data: [DONE]":
                return first if first is not None else -1.0, True
    return -1.0, False


async def pipelined(nats_url: str, prefill: int) -> int:
    """Stages run so far over the prefill instances (a pipeline of X counts X)."""
    nc = await nats.connect(nats_url)
    try:
        n = 0
        for i in range(prefill):
            m = await nc.request(subjects.worker_stats("prefill", f"prefill-{i}"), b"{}", 5)
            n += decode(m.data, WorkerStats).counters.get("cpp_stages_run", 0)
        return n
    finally:
        await nc.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--groups", type=int, nargs="+", default=[1, 2])
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--tokens", type=int, default=6000)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--speedup", type=float, default=0.2)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", default="")
    p.add_argument("--logs", default="", help="keep the stacks' logs here (default: none)")
    a = p.parse_args()
    cost = CostModel.llama3_70b_a800(speedup=a.speedup)
    out: dict = {"setup": vars(a), "groups": {}}
    rng = random.Random(0)
    for x in a.groups:
        est = chunk_timing.pipeline_timing([cost] * x, a.tokens, 0, a.chunk).ttft_s
        with tempfile.TemporaryDirectory() as tmp:
            cfg = StackConfig(
                port=free_port(),
                log_dir=str(Path(a.logs) / f"x{x}") if a.logs else tmp,
                engine="mock",
                prefill=a.prefill,
                decode=1,
                speedup=str(a.speedup),
                cpp_group=x,
                cpp_chunk_tokens=a.chunk,
                cpp_min_tokens=a.chunk + 1,
            )
            with Stack(cfg) as s:
                got, stages = [], 0
                for _ in range(a.runs):
                    ids = [rng.randrange(3, 1000) for _ in range(a.tokens)]
                    t, done = asyncio.run(ttft(s.url, ids))
                    now = asyncio.run(pipelined(s.nats_url, a.prefill))
                    got.append((t, done, now > stages))
                    stages = now
        ok = [(round(t, 3), p) for t, done, p in got if done and t >= 0]
        out["groups"][str(x)] = {
            "est_ttft_s": est,
            "ttft_s": [t for t, _ in ok],
            "pipelined": [p for _, p in ok],
            "failed": len(got) - len(ok),
        }
        print(f"X={x}: est {est:.3f} s, live TTFT (s, pipelined) {ok}, failed {len(got) - len(ok)}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
