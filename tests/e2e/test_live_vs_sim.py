"""Live and simulated agree (issue 5 item 9): a slice of the conversation trace replayed
through the live stack (mock engine) and through the simulator, same cost model, same
speedup, same cluster shape, same block size and store capacity.

The trace stamps arrivals in 3 s steps (~10 requests share each timestamp), so which of
a step's requests reaches the live conductor first is down to task scheduling, and with
it who queues behind whom: run to run that alone moved the simulator's median TTFT over
0.55-0.74 s (20 orderings of the first 80 requests). Both sides therefore replay the
slice with each step's requests spread evenly over the step (``spread_ties``), an order
the live stack keeps. At replay speed 2 the two prefill instances run ~90 % busy, so
the median request queues (~0.4 s of a ~0.67 s TTFT) and the comparison covers the
placement and queueing, not just the cost model. ``simulate_slice`` models what the
live stack adds: load reports every 0.1 s on per-worker timers, the conductor's report
grace, and the control plane's measured latencies (perigee/sim/simulator.py LIVE_*).
"""

import asyncio

import pytest

from perigee.replay import replay, summarize
from perigee.sim import simulate_slice
from perigee.trace import PromptBuilder, load_trace, spread_ties
from tests.e2e.conftest import make_stack

pytestmark = pytest.mark.e2e

SLICE = 80  # ~27 s of trace, 13.5 s of replay
SPEED = 2.0  # trace time / 2: prefill ~90 % busy, the median request queues
SPEEDUP = 0.125  # mock engine 8x slower than the paper's A800 node: prefill dominates bus overhead
BLOCK = 32  # tokens per trace hash id == the stack's hash block size
OUTPUT_SCALE = 0.02
CAPACITY_BLOCKS = 4096


@pytest.fixture(scope="module")
def live_stack(tmp_path_factory):
    s = make_stack(
        tmp_path_factory,
        "live-vs-sim",
        prefill=2,
        decode=1,
        speedup=str(SPEEDUP),
        block_size=BLOCK,
        store_capacity_blocks=CAPACITY_BLOCKS,
    )
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def results(live_stack):
    trace = spread_ties(load_trace(limit=SLICE))
    outs, wall = asyncio.run(
        replay(
            trace,
            live_stack.url,
            speedup=SPEED,
            builder=PromptBuilder(BLOCK, 1024),
            model=None,
            output_scale=OUTPUT_SCALE,
            max_output=4096,
            api_key=None,
            progress=False,
        )
    )
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
    print(
        f"hit rate live {live['cached_token_ratio']:.4f} sim {sim['cache_hit_rate']:.4f}; "
        f"TTFT p50 live {live['ttft_s']['p50']:.4f}s sim {sim['ttft_s']['p50']:.4f}s "
        f"({live['ttft_s']['p50'] / sim['ttft_s']['p50'] - 1:+.1%})"
    )
    return live, sim


def test_live_and_simulated_agree_on_hit_rate(results):
    live, sim = results
    assert live["completed"] == SLICE, live
    assert sim["completed"] == SLICE, sim
    assert abs(live["cached_token_ratio"] - sim["cache_hit_rate"]) <= 0.05


def test_live_and_simulated_agree_on_median_ttft(results):
    live, sim = results
    assert abs(live["ttft_s"]["p50"] - sim["ttft_s"]["p50"]) <= 0.2 * sim["ttft_s"]["p50"]
