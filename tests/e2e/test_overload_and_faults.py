"""Early rejection and a dead decode worker, each on a stack of its own."""

import asyncio
import signal

import aiohttp
import pytest

from tests.e2e.conftest import make_stack
from tests.e2e.helpers import worker_stats
from tests.e2e.sse import stream

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def tight_slo_stack(tmp_path_factory):
    # At the paper's A800 speed a 200-token prefill alone is predicted at ~9 ms: a
    # 1 ms TTFT SLO can never be met, so every request must be rejected up front.
    s = make_stack(tmp_path_factory, "tight", engine="mock", speedup="1", ttft_slo=0.001)
    s.start()
    yield s
    s.stop()


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


async def test_killed_decode_worker_fails_its_streams_others_continue(two_decode_stack):
    s = two_decode_stack
    body = {"prompt": "a long story " * 20, "max_tokens": 400, "ignore_eos": True}
    async with aiohttp.ClientSession() as http:
        tasks = [asyncio.create_task(stream(http, s.url, body)) for _ in range(6)]

        async def decode0_busy():
            while (await worker_stats(s.nats_url, "decode", "decode-0")).get("running", 0) == 0:
                await asyncio.sleep(0.05)

        await asyncio.wait_for(decode0_busy(), 30)
        s.kill("decode-0", signal.SIGKILL)
        # Bounded: dead-after (2 s) plus the watchdog sweep; generous for a loaded CI box.
        results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        failed = [r for r in results if r.error is not None or r.status != 200]
        ok = [r for r in results if r.status == 200 and r.done and r.error is None]
        assert failed, "the killed worker had requests; their clients must see an error"
        assert len(failed) + len(ok) == len(results)
        for r in failed:
            msg = (r.error or {}).get("error", {}).get("message", "")
            assert "decode-0" in msg or r.status == 503, r.error
        for r in ok:
            assert r.usage["completion_tokens"] == 400
        # New work is placed on the surviving decode instance.
        after = await stream(http, s.url, {"prompt": "after the crash", "max_tokens": 3,
                                           "ignore_eos": True})
    assert after.status == 200 and after.done, after.error
