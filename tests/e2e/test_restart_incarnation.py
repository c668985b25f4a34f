"""A restart is a new instance (issue 21): ``perigee up``'s supervisor brings a SIGKILLed
worker back under the same name within a second, and the request it held goes on.

Real nats-server, real processes, the mock engine at a quarter of the paper's A800 speed
(a 400-token stream lasts seconds, a 5,000-token prefill more than one). The gateway's
silence and progress timers are set out of reach (``--dead-after``/``--wedge-floor`` 600 s
on the gateway alone): only the restarted process's new incarnation can tell the gateway
that the old one died, so a stream that completes here proves that path."""

import asyncio
import json
import signal
import urllib.request
from pathlib import Path

import aiohttp
import nats
import pytest

from perigee.supervise import RestartPolicy
from tests.e2e.conftest import make_stack
from tests.e2e.sse import StreamResult, stream

pytestmark = pytest.mark.e2e

DEADLINE_S = 90.0


@pytest.fixture(scope="module")
def restarting(tmp_path_factory):
    s = make_stack(
        tmp_path_factory,
        "restart",
        engine="mock",
        prefill=1,
        decode=1,
        speedup="0.25",
        supervise=True,
        restart_policy=RestartPolicy(max_restarts=5, window_s=600.0, backoff_s=0.2),
        service_args={"gateway": ["--dead-after=600", "--wedge-floor=600"]},
    )
    s.start()
    yield s
    s.stop()


class Tap:
    """Every stream event on the bus (the admin login sees the gateways' replies)."""

    def __init__(self) -> None:
        self.events: list[dict] = []

    async def start(self, url: str) -> "Tap":
        self.nc = await nats.connect(url)

        async def on(m) -> None:
            obj = json.loads(m.data) if m.data else None
            if isinstance(obj, dict) and "type" in obj:
                self.events.append(obj)

        await self.nc.subscribe("perigee.gw.>", cb=on)
        # Twice: nats-py's flush() PING can overtake a SUB still in its pending buffer.
        await self.nc.flush()
        await self.nc.flush()
        return self

    def seen(self, kind: str, rid_prefix: str = "") -> list[dict]:
        return [
            e
            for e in self.events
            if e["type"] == kind and e.get("request_id", "").startswith(rid_prefix)
        ]


async def _until(cond, what: str) -> None:
    async def loop():
        while not cond():
            await asyncio.sleep(0.02)

    try:
        await asyncio.wait_for(loop(), DEADLINE_S)
    except TimeoutError:
        pytest.fail(f"not within {DEADLINE_S:g} s: {what}")


def _migrations(s) -> float:
    """The conductor's perigee:migrations_total, every reason."""
    with urllib.request.urlopen(s.metrics_urls["conductor"], timeout=5) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("perigee:migrations_total{")
    )


async def _stream_with(s, body: dict, during) -> StreamResult:
    """Stream ``body``; ``during(chunks)`` runs beside it (and kills). Started before the
    post: the response's headers come with its first token."""
    chunks: list[dict] = []
    killer = asyncio.ensure_future(during(chunks))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=DEADLINE_S)) as http:
        res = await stream(http, s.url, body, chunks=chunks)
    await killer
    return res


async def test_a_decode_worker_restarted_within_a_second_does_not_strand_its_stream(restarting):
    s = restarting
    before = _migrations(s)
    n = s.restarts.get("decode-0", 0)

    async def kill_after_22(chunks):
        await _until(lambda: len(chunks) >= 22, "22 chunks")
        s.kill("decode-0", signal.SIGKILL)
        await _until(lambda: s.restarts.get("decode-0", 0) > n, "decode-0 restarted")

    body = {"prompt": [5] * 64, "max_tokens": 400, "ignore_eos": True}
    r = await _stream_with(s, body, kill_after_22)
    assert r.status == 200 and r.error is None and r.done, (r.status, r.error)
    assert r.usage["completion_tokens"] == 400
    assert sum(1 for c in r.chunks if c.get("choices")) >= 400 - 22  # every token came
    assert _migrations(s) >= before + 1
    log = (Path(s.cfg.log_dir) / "gateway.log").read_text()
    assert '"instance_restarted"' in log and "restarted (a new incarnation)" in log


async def test_a_prefill_worker_restarted_within_a_second_does_not_strand_its_request(restarting):
    s = restarting
    tap = await Tap().start(s.nats_url)
    before = _migrations(s)
    n = s.restarts.get("prefill-0", 0)
    state = {}

    async def kill_in_prefill(chunks):
        await _until(lambda: tap.seen("accepted"), "the request accepted")
        state["tokens_before_kill"] = len(tap.seen("tokens")) + len(chunks)
        s.kill("prefill-0", signal.SIGKILL)
        await _until(lambda: s.restarts.get("prefill-0", 0) > n, "prefill-0 restarted")

    # ~1.3 s of prefill at this speed: the kill lands while it computes.
    body = {"prompt": [7] * 5000, "max_tokens": 50, "ignore_eos": True}
    r = await _stream_with(s, body, kill_in_prefill)
    await tap.nc.close()
    assert state["tokens_before_kill"] == 0, "the prefill was over before the kill"
    assert r.status == 200 and r.error is None and r.done, (r.status, r.error)
    assert r.usage["completion_tokens"] == 50
    assert _migrations(s) >= before + 1
    assert s.restarts["prefill-0"] == n + 1
