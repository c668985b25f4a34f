"""The only decode instance restarts slower than the gateway judges it dead: the
migration finds no live decode instance, and instead of a 503 it waits for the
restarted one (``--migration-wait``), as a vLLM engine's restart takes tens of seconds.

Real nats-server, real processes, the mock engine; ``perigee up``'s supervisor restarts
the SIGKILLed worker after a 4 s back-off, twice the gateway's --dead-after (2 s), so the
gateway migrates before any decode instance is up. Without the wait the stream ends in
"no live decode instance"."""

import asyncio
import signal
from pathlib import Path

import aiohttp
import pytest

from perigee.supervise import RestartPolicy
from tests.e2e.conftest import make_stack
from tests.e2e.sse import stream
from tests.e2e.test_restart_incarnation import DEADLINE_S, _migrations, _until

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def slow_restart(tmp_path_factory):
    s = make_stack(
        tmp_path_factory,
        "migration-wait",
        engine="mock",
        prefill=1,
        decode=1,
        speedup="0.25",
        supervise=True,
        restart_policy=RestartPolicy(max_restarts=5, window_s=600.0, backoff_s=4.0),
    )
    s.start()
    yield s
    s.stop()


async def test_a_migration_waits_for_the_only_decode_instance_to_come_back(slow_restart):
    s = slow_restart
    before = _migrations(s)
    n = s.restarts.get("decode-0", 0)
    chunks: list[dict] = []

    async def kill_after_22():
        await _until(lambda: len(chunks) >= 22, "22 chunks")
        s.kill("decode-0", signal.SIGKILL)

    killer = asyncio.ensure_future(kill_after_22())
    body = {"prompt": [5] * 64, "max_tokens": 400, "ignore_eos": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=DEADLINE_S)) as http:
        r = await stream(http, s.url, body, chunks=chunks)
    await killer
    assert r.status == 200 and r.error is None and r.done, (r.status, r.error)
    assert r.usage["completion_tokens"] == 400
    assert sum(1 for c in r.chunks if c.get("choices")) >= 400 - 22
    assert s.restarts["decode-0"] == n + 1
    assert _migrations(s) >= before + 1
    log = (Path(s.cfg.log_dir) / "gateway.log").read_text()
    # The migration was answered "no live decode instance" at least once and waited.
    assert '"migration_waiting"' in log and "no live decode instance" in log
