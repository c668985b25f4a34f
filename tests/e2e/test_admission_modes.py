"""The admission mode on real processes (perigee.stack sets PERIGEE_ADMISSION_MODE for
admission, the conductor and the workers): the same overload is refused where the mode
says. A request joins a decode instance that is already busy under a TBT SLO nobody can
meet: in ``early`` admission refuses it at the door and no prefill is spent on it; in
``baseline`` admission and placement let it through and the decode instance refuses it
after its prefill."""

import asyncio

import aiohttp
import nats
import pytest

from bus_schemas import subjects
from bus_schemas.codec import decode
from bus_schemas.load import DecodeLoad
from services.common.admission_mode import AdmissionMode
from tests.e2e.conftest import make_stack
from tests.e2e.helpers import worker_stats
from tests.e2e.sse import stream

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module", params=[AdmissionMode.BASELINE, AdmissionMode.EARLY])
def mode_stack(request, tmp_path_factory):
    # At the paper's A800 speed (speedup 1) a decode step takes tens of ms: a 1 us TBT
    # SLO is over on any busy decode instance; an idle one still takes a request
    # (serve_when_idle, the stack's default), so the first request is served.
    s = make_stack(
        tmp_path_factory,
        f"mode-{request.param}",
        speedup="1",
        tbt_slo=1e-6,
        admission_mode=request.param,
    )
    s.start()
    yield request.param, s
    s.stop()


async def _decode_busy(nats_url: str) -> None:
    """Until decode-0 reports a running request (what admission's decision reads)."""
    nc = await nats.connect(nats_url)
    try:
        sub = await nc.subscribe(subjects.load_report("decode", "decode-0"))
        while True:
            load = decode((await sub.next_msg(timeout=30)).data, DecodeLoad)
            if load.batch_size >= 1:
                return
    finally:
        await nc.close()


async def test_overload_is_refused_where_the_mode_says(mode_stack):
    mode, s = mode_stack
    long_body = {"prompt": "a long story", "max_tokens": 4000, "ignore_eos": True}
    async with aiohttp.ClientSession() as http:
        busy = asyncio.create_task(_decode_busy(s.nats_url))
        first = asyncio.create_task(stream(http, s.url, long_body))
        await asyncio.wait_for(busy, 60)
        assert not first.done()  # 4,000 tokens at tens of ms each: still decoding
        before = await worker_stats(s.nats_url, "prefill", "prefill-0")
        r = await stream(http, s.url, {"prompt": "one more", "max_tokens": 4})
        after = await worker_stats(s.nats_url, "prefill", "prefill-0")
        first.cancel()
    assert r.status == 429, r
    message = r.error["error"]["message"]
    prefilled = after.get("tasks_done", 0) - before.get("tasks_done", 0)
    if mode == AdmissionMode.BASELINE:
        assert "after prefill" in message, message
        assert prefilled == 1  # the prefill was spent, then refused
    else:
        assert "decode pool overloaded" in message, message
        assert prefilled == 0
