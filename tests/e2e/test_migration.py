"""Migration on the mock engine (issue 13): a prefill worker SIGKILLed with requests
before their first token has them placed again; with ``--migration-limit 0`` a dead
decode worker's clients get a clear error instead. (A dead decode worker's streams
going on: test_overload_and_faults; token-exact on the real model: test_real_model.)"""

import asyncio
import signal

import aiohttp
import nats
import pytest

from bus_schemas import subjects
from bus_schemas.codec import decode
from bus_schemas.load import PrefillLoad
from tests.e2e.conftest import make_stack
from tests.e2e.helpers import worker_stats
from tests.e2e.sse import stream
from tests.e2e.test_overload_and_faults import metric

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def two_prefill_stack(tmp_path_factory):
    # 20x slower than the paper's A800: a ~1.5k-token prefill takes over a second, so
    # prefill-0 holds queued requests when it is killed (and decode steps, slower too,
    # must not trip admission's TBT check).
    s = make_stack(
        tmp_path_factory, "mig-prefill", prefill=2, decode=1, speedup="0.05", tbt_slo=10.0
    )
    s.start()
    yield s
    s.stop()


def prompts(n: int) -> list[str]:
    return [f"story {i}: " + "the quick brown fox jumps over the lazy dog " * 60 for i in range(n)]


async def test_killed_prefill_worker_has_its_requests_placed_again(two_prefill_stack):
    s = two_prefill_stack
    nc = await nats.connect(s.nats_url)
    queued = asyncio.Event()

    async def on_load(m) -> None:
        if decode(m.data, PrefillLoad).queue_len >= 2:
            queued.set()

    await nc.subscribe(subjects.load_report("prefill", "prefill-0"), cb=on_load)
    bodies = [{"prompt": p, "max_tokens": 4, "ignore_eos": True} for p in prompts(6)]
    try:
        async with aiohttp.ClientSession() as http:
            tasks = [asyncio.create_task(stream(http, s.url, b)) for b in bodies]
            await asyncio.wait_for(queued.wait(), 60)
            s.kill("prefill-0", signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            for r in results:
                assert r.status == 200 and r.done and r.error is None, r.error
                assert r.usage["completion_tokens"] == 4
            migrated = await metric(
                http, s.metrics_urls["conductor"], "perigee:migrations_total", reason="prefill_died"
            )
            assert migrated >= 2, "prefill-0 held queued requests: they must have been placed again"
            # Undisturbed runs of the same prompts give the same tokens.
            for b, r in zip(bodies, results, strict=True):
                ref = await stream(http, s.url, b)
                assert ref.status == 200 and ref.done, ref.error
                assert r.text == ref.text
    finally:
        await nc.close()
    assert (await worker_stats(s.nats_url, "prefill", "prefill-1"))["tasks_done"] >= 6


@pytest.fixture(scope="module")
def no_migration_stack(tmp_path_factory):
    s = make_stack(tmp_path_factory, "mig-off", prefill=1, decode=2, speedup="1", migration_limit=0)
    s.start()
    yield s
    s.stop()


async def test_migration_limit_0_fails_a_dead_decode_workers_streams(no_migration_stack):
    s = no_migration_stack
    body = {"prompt": "a long story " * 20, "max_tokens": 400, "ignore_eos": True}
    async with aiohttp.ClientSession() as http:
        tasks = [asyncio.create_task(stream(http, s.url, body)) for _ in range(6)]

        async def decode0_busy():
            while (await worker_stats(s.nats_url, "decode", "decode-0")).get("running", 0) == 0:
                await asyncio.sleep(0.05)

        await asyncio.wait_for(decode0_busy(), 30)
        s.kill("decode-0", signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        failed = [r for r in results if r.error is not None or r.status != 200]
        assert failed, "decode-0 had requests: with migration off their clients see an error"
        for r in failed:
            msg = (r.error or {}).get("error", {}).get("message", "")
            assert "decode instance decode-0 stopped responding" in msg, r.error
            assert "migration is off (--migration-limit 0)" in msg, r.error
        for r in results:
            if r not in failed:
                assert r.done and r.usage["completion_tokens"] == 400
        assert (
            await metric(
                http, s.metrics_urls["conductor"], "perigee:migrations_total", reason="decode_died"
            )
            == 0
        )
