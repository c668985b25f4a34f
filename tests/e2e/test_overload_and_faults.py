"""Early rejection and a dead decode worker (its requests migrate), each on a stack of its own."""

import asyncio
import signal

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import make_stack
from tests.e2e.helpers import worker_stats
from tests.e2e.sse import stream

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def tight_slo_stack(tmp_path_factory):
    # At the paper's A800 speed a 200-token prefill alone is predicted at ~9 ms: a
    # 1 ms TTFT SLO can never be met, so with the paper's Algorithm 1 (no serving on an
    # idle instance) every request must be rejected up front.
    s = make_stack(
        tmp_path_factory,
        "tight",
        engine="mock",
        speedup="1",
        ttft_slo=0.001,
        serve_when_idle=False,
    )
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tight_idle_stack(tmp_path_factory):
    s = make_stack(tmp_path_factory, "tight-idle", engine="mock", speedup="1", ttft_slo=0.001)
    s.start()
    yield s
    s.stop()


async def test_an_idle_stack_serves_a_request_its_slo_cannot_fit(tight_idle_stack):
    """The default: an idle instance takes a request predicted over the SLO (no later
    placement could be faster, so a 429 "retry later" would be false)."""
    s = tight_idle_stack
    async with aiohttp.ClientSession() as http:
        r = await stream(http, s.url, {"prompt": "word " * 200, "max_tokens": 4})
    assert r.status == 200 and r.done, (r.status, r.error)
    stats = await worker_stats(s.nats_url, "prefill", "prefill-0")
    assert stats.get("tasks_done", 0) == 1


async def test_unmeetable_slo_gets_429_and_no_prefill_work(tight_slo_stack):
    s = tight_slo_stack
    prompt = "word " * 200
    async with aiohttp.ClientSession() as http:
        r = await stream(http, s.url, {"prompt": prompt, "max_tokens": 4})
    assert r.status == 429
    assert int(r.headers["Retry-After"]) >= 1
    assert r.error["error"]["type"] == "rate_limit_exceeded"
    stats = await worker_stats(s.nats_url, "prefill", "prefill-0")
    assert stats.get("tasks_done", 0) == 0
    assert stats.get("computed_tokens", 0) == 0


@pytest.fixture(scope="module")
def two_decode_stack(tmp_path_factory):
    s = make_stack(tmp_path_factory, "faults", engine="mock", prefill=1, decode=2, speedup="1")
    s.start()
    yield s
    s.stop()


async def test_killed_decode_worker_streams_continue_on_the_other(two_decode_stack):
    """SIGKILL decode-0 mid-stream: its requests migrate to decode-1 (issue 13) and every
    client gets all 400 tokens, the same as an undisturbed run (the mock's tokens follow
    the context, so a lost, repeated or shifted token changes the text)."""
    s = two_decode_stack
    body = {"prompt": "a long story " * 20, "max_tokens": 400, "ignore_eos": True}
    async with aiohttp.ClientSession() as http:
        ref = await stream(http, s.url, body)
        assert ref.status == 200 and ref.done, ref.error
        tasks = [asyncio.create_task(stream(http, s.url, body)) for _ in range(6)]

        async def decode0_busy():
            while (await worker_stats(s.nats_url, "decode", "decode-0")).get("running", 0) == 0:
                await asyncio.sleep(0.05)

        await asyncio.wait_for(decode0_busy(), 30)
        s.kill("decode-0", signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        for r in results:
            assert r.status == 200 and r.done and r.error is None, r.error
            assert r.usage["completion_tokens"] == 400
            assert r.text == ref.text
        migrated = await metric(
            http, s.metrics_urls["conductor"], "perigee:migrations_total", reason="decode_died"
        )
        assert migrated >= 1, "decode-0 had requests: they must have migrated"
        d1 = await worker_stats(s.nats_url, "decode", "decode-1")
        assert d1["migrated_tasks"] == migrated
        # The prompt's full blocks came from a store, not from a new prefill.
        full = ref.usage["prompt_tokens"] // 32 * 32
        assert d1["migration_kv_tokens_pulled"] == migrated * full
        pulled = await metric(
            http, s.metrics_urls["decode-1"], "perigee:migration_kv_tokens_total", kind="pulled"
        )
        assert pulled == migrated * full
        # New work is placed on the surviving decode instance.
        after = await stream(
            http, s.url, {"prompt": "after the crash", "max_tokens": 3, "ignore_eos": True}
        )
    assert after.status == 200 and after.done, after.error


async def metric(http: aiohttp.ClientSession, url: str, sample: str, **labels: str) -> float:
    async with http.get(url) as r:
        text = await r.text()
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name == sample and all(smp.labels.get(k) == v for k, v in labels.items()):
                return smp.value
    return 0.0
