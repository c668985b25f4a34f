"""``perigee bench agreement [--json PATH]``: does the simulator predict the live stack?

A slice of the conversation trace replayed through the live stack (mock engine, real
nats-server, stores and services) and through the simulator with the same cost model,
speedup, cluster shape, block size and store capacity: their cache hit rates and median
TTFTs side by side, the live/simulated ratio of the medians the figure of merit (1.0:
the simulator predicts the live stack exactly). The settings are those of
``tests/e2e/test_live_vs_sim.py``, which checks the hit rates (not the timing) on every
test run; the median TTFT lives here because it is a speed.

Each trace step's requests are spread evenly over the step (``spread_ties``) on both
sides: which of ten requests stamped alike reaches the conductor first is otherwise
down to task scheduling, and it alone moved the simulated median by a third.
"""

import argparse
import asyncio
import json
import os
import tempfile

from perigee.natsd import free_port
from perigee.replay import replay, summarize
from perigee.sim import simulate_slice
from perigee.stack import Stack, StackConfig
from perigee.trace import PromptBuilder, load_trace, spread_ties

SLICE = 80  # ~27 s of trace, 13.5 s of replay
SPEED = 2.0  # trace time / 2: prefill ~90 % busy, the median request queues
SPEEDUP = 0.125  # mock engine 8x slower than the paper's A800 node: prefill dominates
BLOCK = 32  # tokens per trace hash id == the stack's hash block size
OUTPUT_SCALE = 0.02
CAPACITY_BLOCKS = 4096


def run(requests: int = SLICE, log_dir: str | None = None) -> dict:
    trace = spread_ties(load_trace(limit=requests))
    cfg = StackConfig(
        port=free_port(),
        log_dir=log_dir or tempfile.mkdtemp(prefix="perigee-agreement-"),
        engine="mock",
        prefill=2,
        decode=1,
        speedup=str(SPEEDUP),
        block_size=BLOCK,
        store_capacity_blocks=CAPACITY_BLOCKS,
    )
    stack = Stack(cfg)
    stack.start()
    try:
        outs, wall = asyncio.run(
            replay(
                trace,
                stack.url,
                speedup=SPEED,
                builder=PromptBuilder(BLOCK, 1024),
                model=None,
                output_scale=OUTPUT_SCALE,
                max_output=4096,
                api_key=None,
                progress=False,
            )
        )
    finally:
        stack.stop()
    live = summarize(outs, wall, ttft_slo=30.0, tbt_slo=1.0)
    sim = simulate_slice(
        trace,
        speedup=SPEEDUP,
        block_size=BLOCK,
        prefill=2,
        decode=1,
        speed=SPEED,
        output_scale=OUTPUT_SCALE,
        cache_tokens_per_node=CAPACITY_BLOCKS * BLOCK,
    )
    return {
        "requests": requests,
        "load_avg_1m": os.getloadavg()[0],
        "live": {
            "completed": live["completed"],
            "hit_rate": live["cached_token_ratio"],
            "ttft_p50_s": live["ttft_s"]["p50"],
        },
        "sim": {
            "completed": sim["completed"],
            "hit_rate": sim["cache_hit_rate"],
            "ttft_p50_s": sim["ttft_s"]["p50"],
        },
        "ttft_p50_live_over_sim": live["ttft_s"]["p50"] / sim["ttft_s"]["p50"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="perigee bench agreement", description=__doc__)
    p.add_argument("--requests", type=int, default=SLICE)
    p.add_argument("--log-dir")
    p.add_argument("--json")
    a = p.parse_args(argv)
    out = run(a.requests, a.log_dir)
    live, sim = out["live"], out["sim"]
    print(
        f"{out['requests']} requests (load {out['load_avg_1m']:.1f}): "
        f"completed live {live['completed']} sim {sim['completed']}; "
        f"hit rate live {live['hit_rate']:.4f} sim {sim['hit_rate']:.4f}; "
        f"TTFT p50 live {live['ttft_p50_s']:.4f}s sim {sim['ttft_p50_s']:.4f}s "
        f"(live/sim {out['ttft_p50_live_over_sim']:.3f})"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0
