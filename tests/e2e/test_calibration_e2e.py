"""Online calibration through a real stack: the prefill instance's mock engine runs at
the paper's A800 speed (``--engine-speedup 1``) while every service assumes 100x that
(``--speedup 100``), so the prior is off by 100x. After the warm-up that gates /ready,
the conductor's estimate for the instance must follow what the instance measures."""

import asyncio
from pathlib import Path

import aiohttp
import pytest

from perigee import breakdown as bd
from perigee.natsd import free_port
from perigee.stack import Stack, StackConfig
from services.common.cost_model import CostModel
from tests.e2e.sse import post

pytestmark = pytest.mark.e2e

PRIOR = CostModel(speedup=100.0)  # what conductor and admission assume
FACTOR = 3.0  # generous: the estimate is a fit, the measurement has a busy CPU in it


class SlowPrefillStack(Stack):
    """The prefill engine 100x slower than the stack's --speedup says."""

    def plan(self):
        children = super().plan()
        for c in children:
            if c.name == "prefill-0":
                c.argv += ["--engine-speedup", "1"]
        return children


@pytest.fixture(scope="module")
def slow_stack(tmp_path_factory):
    cache = tmp_path_factory.mktemp("perigee-cache")
    cfg = StackConfig(
        port=free_port(),
        log_dir=str(tmp_path_factory.mktemp("logs-calib")),
        engine="mock",
        prefill=1,
        decode=1,
        speedup="100",
        trace_rate=0.0,  # every request: the test reads their spans
        extra_env={"PERIGEE_CACHE_DIR": str(cache)},
    )
    s = SlowPrefillStack(cfg)
    s.start()
    s.cache_dir = cache
    yield s
    s.stop()


def place_spans(path: str, request_ids: set[str]) -> dict[str, dict]:
    out = {}
    for s in bd.read_spans(path):
        a = s.get("attributes", {})
        if (
            s["name"] == "conductor.place"
            and a.get("request_id") in request_ids
            and a.get("outcome") == "placed"
        ):
            out[a["request_id"]] = s
    return out


async def wait_for(fn, timeout: float = 30.0):
    async with asyncio.timeout(timeout):
        while not (got := fn()):
            await asyncio.sleep(0.1)
    return got


async def test_conductor_estimate_follows_what_the_instance_measures(slow_stack):
    s = slow_stack
    async with aiohttp.ClientSession() as http:
        for i in range(4):  # one at a time: the queue stays empty, the estimate is the fit
            words = " ".join(f"w{i}x{j}" for j in range(700))
            st, _, body = await post(
                http, s.url, {"prompt": f"Request {i}: {words}", "max_tokens": 2}
            )
            assert st == 200, body

    def traced():
        traces = bd.by_trace(bd.read_spans(s.spans_file))
        found = {}
        for t in traces.values():
            r = bd.breakdown(t)
            place = next((x for x in t if x["name"] == "conductor.place"), None)
            compute = next((x for x in t if x["name"] == "prefill.compute"), None)
            if r is not None and place is not None and compute is not None:
                found[r.request_id] = (r, place, compute)
        return found if len(found) >= 4 else None

    found = await wait_for(traced)
    for r, place, compute in found.values():
        a = place["attributes"]
        n = a["prompt_tokens"]
        est_ttft = a["est_ttft_s"]
        est_prefill = est_ttft - a["est_queue_s"] - a["est_transfer_s"]
        measured_prefill = (compute["end_ns"] - compute["start_ns"]) / 1e9
        measured_ttft = r.ttft_ns / 1e9
        # The prior would say 100x less than what the engine takes.
        assert measured_prefill > 20 * PRIOR.prefill_time(n)
        assert measured_prefill / FACTOR <= est_prefill <= measured_prefill * FACTOR, (
            n,
            est_prefill,
            measured_prefill,
        )
        assert measured_ttft / FACTOR <= est_ttft <= measured_ttft * FACTOR, (
            n,
            est_ttft,
            measured_ttft,
        )

    # The worker's metric saw every request's prediction, and the fit is kept on disk.
    async with aiohttp.ClientSession() as http:
        async with http.get(s.metrics_urls["prefill-0"]) as resp:
            text = await resp.text()
    count = next(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("perigee:prefill_time_predicted_over_measured_count")
    )
    assert count >= 4
    assert list(Path(s.cache_dir, "fits").glob("*.json"))
