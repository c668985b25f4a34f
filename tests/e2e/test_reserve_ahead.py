"""The conductor sends the reservation's first round ahead of the task to an idle prefill
instance (services.prefill.reserve_ahead), through the whole stack: each request's
first round is the one the stores answered the instance, nothing is allocated twice,
nothing aborted, and no transaction stays open."""

import asyncio

import aiohttp
import pytest

from tests.e2e.helpers import worker_stats

pytestmark = pytest.mark.e2e

N = 4


async def open_txs(nats_url: str) -> int:
    return sum([(await worker_stats(nats_url, "store", n))["open_txs"] for n in ("p0", "d0")])


async def test_an_idle_instance_takes_the_round_its_conductor_sent(stack):
    before = await worker_stats(stack.nats_url, "prefill", "prefill-0")
    body = {"prompt": "reserved ahead", "max_tokens": 4, "ignore_eos": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        for _ in range(N):  # one at a time: the instance is idle for each
            async with s.post(stack.url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                assert (await r.json())["usage"]["completion_tokens"] == 4
    after = await worker_stats(stack.nats_url, "prefill", "prefill-0")
    delta = {
        k: after[k] - before.get(k, 0) for k in ("ahead_taken", "ahead_missing", "ahead_aborted")
    }
    assert delta == {"ahead_taken": N, "ahead_missing": 0, "ahead_aborted": 0}
    async with asyncio.timeout(10):  # the prefill commits are the conductor's, unanswered
        while await open_txs(stack.nats_url):
            await asyncio.sleep(0.1)
