"""The core path (no JetStream intake): a SIGKILLed conductor that held requests before
placing them loses none. The gateway hears admission's and the conductors' presence
beats and resends what was not placed when one dies (services.gateway.control_presence).
Real nats-server, real processes, the mock engine, a supervised stack.

The fault is made certain to hold requests: the conductor is SIGSTOPped, a burst is
sent (NATS hands the stopped process its share of the queue group), then it is
SIGKILLed. The resent attempts (``<rid>-m1``) on the prefill task subjects prove it
held some."""

import asyncio
import os
import signal

import aiohttp
import nats
import pytest

from bus_schemas import subjects
from bus_schemas.codec import decode
from bus_schemas.placement import PrefillTask
from bus_schemas.requests import GenerateRequest
from tests.e2e.test_crash_safe_intake import (
    BURST,
    DEADLINE_S,
    assert_served,
    send_burst,
    supervised_stack,
    tasks_done,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def core_stack(tmp_path_factory):
    s = supervised_stack(tmp_path_factory, "core-path")  # the core path: the default
    s.start()
    yield s
    s.stop()


async def stop_burst_kill(s, child: str, prompt: str, resent) -> None:
    """SIGSTOP ``child``, send a burst, wait until ``resent()`` (the gateway judged the
    stopped process dead and sent what it held again), SIGKILL it: every request of the
    burst is served, and the child restarted once."""
    os.kill(s.children[child].proc.pid, signal.SIGSTOP)
    async with aiohttp.ClientSession() as http:
        burst = send_burst(http, s.url, prompt)

        async def until_resent() -> None:
            while not resent():
                await asyncio.sleep(0.05)

        await asyncio.wait_for(until_resent(), DEADLINE_S)
        s.kill(child, signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*burst), DEADLINE_S)
    assert s.restarts.get(child) == 1
    assert_served(results)


async def test_sigkilled_conductor_on_the_core_path_loses_no_request(core_stack):
    s = core_stack
    nc = await nats.connect(s.nats_url)
    placed: dict[str, int] = {}

    async def on_task(m) -> None:
        rid = decode(m.data, PrefillTask).request.request_id
        placed[rid] = placed.get(rid, 0) + 1

    await nc.subscribe(subjects.prefill_tasks("*"), cb=on_task)
    await nc.flush()
    done_before = await tasks_done(s)
    try:
        # The live conductor places its share; the stopped one's share waits in its
        # socket until the gateway judges it dead (silent) and sends those again (half
        # of which the stopped one takes again: its subscription is still up, and they
        # go on once its restart is heard).
        await stop_burst_kill(
            s, "conductor-1", "core path", lambda: any(r.endswith("-m1") for r in placed)
        )
        # The dead conductor placed none of what it held; each attempt placed once, and
        # each request computed once.
        assert all(n == 1 for n in placed.values()), placed
        firsts = {rid.split("-m")[0] for rid in placed}
        assert len(firsts) == BURST
        assert await tasks_done(s) - done_before == BURST
    finally:
        await nc.close()


async def test_sigkilled_admission_on_the_core_path_loses_no_request(core_stack):
    """The only admission, stopped: what it holds is resent once it is silent, and taken
    again by the stopped process (the only subscriber); its restart sends it again."""
    s = core_stack
    nc = await nats.connect(s.nats_url)
    sent: list[str] = []

    async def on_request(m) -> None:
        sent.append(decode(m.data, GenerateRequest).request_id)

    await nc.subscribe(subjects.REQUESTS, cb=on_request)
    await nc.flush()
    done_before = await tasks_done(s)
    try:
        await stop_burst_kill(
            s, "admission", "core path admission", lambda: any(r.endswith("-m1") for r in sent)
        )
        assert any(rid.endswith("-m2") for rid in sent)  # sent again at its restart
        assert await tasks_done(s) - done_before == BURST  # each computed once
    finally:
        await nc.close()
