"""Every service of a running stack serves Prometheus /metrics; after a few requests
the counters and histograms moved by exactly what the requests did."""

import asyncio
import json
import math

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.tokenizer import Tokenizer
from tests.e2e.sse import post

pytestmark = pytest.mark.e2e

N = 3
MAX_TOKENS = 5
EXPECTED = {
    "gateway": [
        "perigee:time_to_first_token_seconds",
        "perigee:inter_token_latency_seconds",
        "perigee:e2e_request_latency_seconds",
        "perigee:request_success",
        "perigee:prompt_tokens",
        "perigee:generation_tokens",
        "perigee:gateway_requests_in_flight",
    ],
    "admission": ["perigee:requests_admitted", "perigee:requests_rejected"],
    "conductor": [
        "perigee:request_scheduling_time_seconds",
        "perigee:requests_rejected",
        "perigee:conductor_pending_requests",
    ],
    "prefill-0": [
        "perigee:num_requests_waiting",
        "perigee:num_requests_running",
        "perigee:prefix_cache_queries",
        "perigee:prefix_cache_hits",
        "perigee:request_queue_time_seconds",
        "perigee:request_prefill_time_seconds",
        "perigee:kv_transfer_time_seconds",
    ],
    "decode-0": [
        "perigee:num_requests_waiting",
        "perigee:num_requests_running",
        "perigee:request_decode_load_time_seconds",
        "perigee:request_decode_time_seconds",
    ],
    "store-p0": [
        "perigee:store_bytes",
        "perigee:transfer_bytes",
        "perigee:transfer_errors",
        "perigee:kv_cache_usage_perc",
    ],
    "store-d0": ["perigee:store_bytes", "perigee:transfer_bytes", "perigee:transfer_errors"],
}


async def scrape(http: aiohttp.ClientSession, url: str) -> dict:
    """{family name: {(sample name, sorted labels): value}}"""
    async with http.get(url) as r:
        assert r.status == 200, url
        text = await r.text()
    out: dict = {}
    for fam in text_string_to_metric_families(text):
        out[fam.name] = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in fam.samples}
    return out


def val(scraped: dict, family: str, sample: str | None = None, **labels) -> float:
    want = (sample or family, tuple(sorted(labels.items())))
    return scraped.get(family, {}).get(want, 0.0)


async def scrape_all(http, stack) -> dict[str, dict]:
    return {name: await scrape(http, url) for name, url in stack.metrics_urls.items()}


async def test_every_service_answers_its_probes_once_the_stack_is_ready(stack):
    """What an orchestrator probes (deploy/k8s): /health and /ready beside /metrics on
    every service but the gateway (which serves its own), 200 once the stack serves."""
    async with aiohttp.ClientSession() as http:
        for name, url in stack.metrics_urls.items():
            if name == "gateway":
                continue
            base = url.removesuffix("/metrics")
            for path in ("/health", "/ready"):
                async with http.get(base + path) as r:
                    assert r.status == 200, (name, path, await r.text())


async def test_every_service_serves_metrics_that_follow_requests(stack):
    targets = json.loads(stack.metrics_targets_file.read_text())
    assert {t["labels"]["service"] for t in targets} == set(stack.metrics_urls) == set(EXPECTED)
    tok = Tokenizer.from_dir(stack.cfg.model_dir)
    prompts = [f"metrics probe {i}: " + "tokens to prefill " * (10 + 7 * i) for i in range(N)]
    prompt_tokens = [len(tok.encode(p)) for p in prompts]
    bs = stack.cfg.block_size
    async with aiohttp.ClientSession() as http:
        before = await scrape_all(http, stack)
        for p in prompts:
            status, _, body = await post(
                http, stack.url, {"prompt": p, "max_tokens": MAX_TOKENS, "ignore_eos": True}
            )
            assert status == 200, body
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        after = await scrape_all(http, stack)
        # The conductor's placement span ends just after it dispatched; wait for it rather
        # than assume it ended before the answer came back.
        sched = "perigee:request_scheduling_time_seconds"
        async with asyncio.timeout(10):
            while (
                val(after["conductor"], sched, sched + "_count")
                - val(before["conductor"], sched, sched + "_count")
            ) < N:
                await asyncio.sleep(0.05)
                after["conductor"] = await scrape(http, stack.metrics_urls["conductor"])

    for service, names in EXPECTED.items():
        for name in names:
            assert name in after[service], (service, name)

    def d(service, family, sample=None, **labels):
        return val(after[service], family, sample, **labels) - val(
            before[service], family, sample, **labels
        )

    model = {"model_name": "tiny-llama"}
    gw = "perigee:time_to_first_token_seconds"
    assert d("gateway", gw, gw + "_count", **model) == N
    assert d("gateway", gw, gw + "_sum", **model) > 0
    itl = "perigee:inter_token_latency_seconds"
    assert d("gateway", itl, itl + "_count", **model) == N * (MAX_TOKENS - 1)
    e2e = "perigee:e2e_request_latency_seconds"
    assert d("gateway", e2e, e2e + "_count", **model) == N
    assert (
        d(
            "gateway",
            "perigee:request_success",
            "perigee:request_success_total",
            finished_reason="length",
            **model,
        )
        == N
    )
    assert (
        d("gateway", "perigee:generation_tokens", "perigee:generation_tokens_total", **model)
        == N * MAX_TOKENS
    )
    assert d("gateway", "perigee:prompt_tokens", "perigee:prompt_tokens_total", **model) == sum(
        prompt_tokens
    )
    assert val(after["gateway"], "perigee:gateway_requests_in_flight") == 0

    assert d("admission", "perigee:requests_admitted", "perigee:requests_admitted_total") == N
    assert d("conductor", sched, sched + "_count") == N

    pf = "prefill-0"
    assert d(pf, "perigee:prefix_cache_queries", "perigee:prefix_cache_queries_total") == sum(
        prompt_tokens
    )
    assert d(pf, "perigee:prefix_cache_hits", "perigee:prefix_cache_hits_total") == 0
    for h in (
        "perigee:request_queue_time_seconds",
        "perigee:request_prefill_time_seconds",
        "perigee:kv_transfer_time_seconds",
    ):
        assert d(pf, h, h + "_count") == N, h
    assert val(after[pf], "perigee:num_requests_running") == 0

    dc = "decode-0"
    for h in ("perigee:request_decode_load_time_seconds", "perigee:request_decode_time_seconds"):
        assert d(dc, h, h + "_count") == N, h
    assert (
        d(dc, "perigee:decode_tokens_generated", "perigee:decode_tokens_generated_total")
        == N * MAX_TOKENS
    )

    # The KV of every block went from the prefill node's store to the decode node's.
    block_bytes = (
        after["store-d0"]["perigee:store_capacity_bytes"][
            ("perigee:store_capacity_bytes", (("tier", "dram"),))
        ]
        / stack.cfg.store_capacity_blocks
    )
    shipped = sum(math.ceil(n / bs) for n in prompt_tokens) * block_bytes
    assert (
        d("store-d0", "perigee:transfer_bytes", "perigee:transfer_bytes_total", direction="in")
        == shipped
    )
    assert (
        d("store-p0", "perigee:transfer_bytes", "perigee:transfer_bytes_total", direction="out")
        == shipped
    )
    for store in ("store-p0", "store-d0"):
        assert (
            d(store, "perigee:transfer_errors", "perigee:transfer_errors_total", kind="transfer")
            == 0
        )
        assert val(after[store], "perigee:store_bytes", tier="dram") > 0
