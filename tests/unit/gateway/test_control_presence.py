"""On the core path an admission or conductor that dies before placing a request takes
it along; the gateway hears their presence beats and resends what was not placed yet
(services.gateway.control_presence, services.gateway.replies). Pure parts with an
injected clock; the gateway's part over a real nats-server, a fake backend playing
admission, the conductors and the workers."""

import asyncio

import aiohttp
import nats
import pytest

from bus_schemas import subjects
from bus_schemas.codec import encode
from bus_schemas.control import Presence
from bus_schemas.requests import Accepted, Tokens
from services.common import presence
from services.common.clock import ManualClock
from services.gateway import control_presence
from services.gateway.control_presence import ControlPresence
from services.gateway.server import Gateway, GatewayConfig
from tests.unit.gateway.test_gateway_http import (
    TOK,
    FakeBackend,
    quiet_backend_gateway,
    read_sse,
    serve_nothing,
    until,
)

OUT = TOK.encode("one two three four", add_bos=False)


def test_a_newer_incarnation_under_a_known_name_is_the_old_ones_death():
    cp = ControlPresence(ManualClock(), dead_after_s=2.0)
    assert cp.seen("conductor", "c0", 100, 0.5) is None  # first heard
    assert cp.seen("conductor", "c0", 100, 0.5) is None  # the same process
    assert cp.seen("conductor", "c1", 50, 0.5) is None  # another name: not a restart
    assert cp.seen("conductor", "c0", 200, 0.5) == "conductor:c0"
    assert cp.seen("conductor", "c0", 100, 0.5) is None  # the dead one's late beat
    assert cp.seen("admission", "c0", 300, 0.5) is None  # names are per kind


def test_silence_past_the_limit_is_a_death_once():
    clock = ManualClock()
    cp = ControlPresence(clock, dead_after_s=2.0)
    cp.seen("admission", "a0", 1, 0.5)
    cp.seen("conductor", "c0", 1, 1.0)  # beats every second: dead after 4 s, not 2
    clock.advance(2.0)
    assert cp.silent() == [] and sorted(cp.alive("admission")) == ["a0"]
    clock.advance(0.01)
    assert cp.silent() == ["admission:a0"]
    assert cp.silent() == []  # one death, one verdict
    assert cp.alive("admission") == [] and cp.alive("conductor") == ["c0"]
    clock.advance(2.0)
    assert cp.silent() == ["conductor:c0"]
    # A hung process judged dead kept its subscriptions: its restart is a death again.
    assert cp.seen("conductor", "c0", 2, 1.0) == "conductor:c0"
    # One that wakes up is alive again, and its next silence another death.
    assert cp.seen("admission", "a0", 1, 0.5) is None
    assert cp.alive("admission") == ["a0"]
    clock.advance(2.01)
    assert cp.silent() == ["admission:a0"]


def test_a_name_silent_for_long_is_forgotten():
    clock = ManualClock()
    cp = ControlPresence(clock, dead_after_s=2.0)
    cp.seen("conductor", "pod-abc", 5, 0.5)
    clock.advance(3.0)
    assert cp.silent() == ["conductor:pod-abc"]
    clock.advance(control_presence.FORGET_S)
    assert cp.silent() == [] and cp.seen("conductor", "pod-abc", 1, 0.5) is None


def test_the_beat_interval_leaves_room_for_a_lost_beat():
    assert presence.interval_for(2.0) == 0.5


@pytest.fixture
async def env(nats_url):
    cfg = GatewayConfig(
        port=0,
        durable_intake=False,  # the core path: what a dead control process takes along
        max_prompt_tokens=64,
        max_tokens_limit=100,
        max_model_len=128,
        dead_after_s=2.0,
        request_timeout_s=30.0,
        sweep_interval_s=0,  # swept by the test, on its clock
        migration_limit=0,  # not a worker's death: resent even so
    )
    clock = ManualClock()
    async with quiet_backend_gateway(nats_url, cfg, clock) as (gw, backend, http):
        gw.router.bus_settle_s = 0.0
        yield gw, backend, http, clock


async def beat(b: FakeBackend, kind: str, name: str, incarnation: int, subject: str = "") -> None:
    p = Presence(kind=kind, name=name, incarnation=incarnation, interval_s=0.5)
    await b.nc.publish(subject or subjects.presence(kind, name), encode(p))
    await b.nc.flush()


async def heard_then_post(gw, b, http, kind: str, name: str, incarnation: int = 1):
    """``kind`` ``name`` beats and the gateway knows it; then one request goes out."""
    await beat(b, kind, name, incarnation)
    await until(lambda: gw.router.control.alive(kind) == [name])
    return await post_one(gw, b, http)


async def post_one(gw, b, http):
    url = f"http://127.0.0.1:{gw.port}/v1/completions"
    body = {"prompt": "hi", "max_tokens": len(OUT), "stream": True, "ignore_eos": True}
    post = asyncio.ensure_future(http.post(url, json=body).__aenter__())
    first, reply = await asyncio.wait_for(b.requests.get(), 5)
    return post, first, reply


async def test_a_restarted_conductor_gets_the_unplaced_request_sent_again(env):
    gw, b, http, _ = env
    post, first, _ = await heard_then_post(gw, b, http, "conductor", "conductor-0")
    assert b.requests.empty()
    await beat(b, "conductor", "conductor-0", 2)  # it died holding the request
    again, reply2 = await asyncio.wait_for(b.requests.get(), 5)
    assert again.request_id == f"{first.request_id}-m1"
    assert again.prompt_token_ids == first.prompt_token_ids
    cancel = await asyncio.wait_for(b.cancels.get(), 5)  # the first, should it be placed
    assert cancel.request_id == first.request_id
    assert gw.router.control_deaths == 1
    post.cancel()


async def test_a_silent_admission_gets_the_unplaced_request_sent_again(env):
    gw, b, http, clock = env
    post, first, _ = await heard_then_post(gw, b, http, "admission", "admission", 7)
    clock.advance(1.9)
    gw.router.sweep()
    assert gw.router.control_deaths == 0
    clock.advance(0.2)
    gw.router.sweep()
    again, _ = await asyncio.wait_for(b.requests.get(), 5)
    assert again.request_id == f"{first.request_id}-m1"
    post.cancel()


async def test_a_placed_request_is_not_sent_again_when_a_conductor_dies(env):
    gw, b, http, _ = env
    post, first, reply = await heard_then_post(gw, b, http, "conductor", "conductor-0")
    rid = first.request_id
    await b.nc.publish(
        reply, encode(Accepted(request_id=rid, prefill_instance="p0", decode_instance="d0"))
    )
    await b.nc.publish(
        reply, encode(Tokens(request_id=rid, token_ids=OUT[:1], index=0, from_prefill=True))
    )
    await b.nc.flush()
    async with await asyncio.wait_for(post, 5):
        await beat(b, "conductor", "conductor-0", 2)
        await until(lambda: gw.router.bus_passes == 1)  # the death came and its pass ran
        assert b.requests.empty() and gw.router.migrations == 0


async def test_a_beat_whose_subject_names_another_process_is_ignored(env):
    gw, b, http, _ = env
    post, _, _ = await heard_then_post(gw, b, http, "conductor", "conductor-0")
    # A newer incarnation claimed on another process's subject proves nothing.
    await beat(b, "conductor", "conductor-0", 2, subject=subjects.presence("conductor", "x"))
    await b.nc.publish(subjects.presence("conductor", "conductor-0"), b"not a beat")
    await beat(b, "conductor", "conductor-0", 1)  # the real one, still alive
    await b.nc.flush()
    await until(lambda: gw.router.bad_events == 1)
    assert gw.router.control_deaths == 0 and b.requests.empty()
    post.cancel()


async def test_a_request_nobody_takes_waits_for_the_admission_that_was_heard():
    """The only admission restarting: the first send is answered "no responders" and is
    sent again until admission is back, as the durable intake would have kept it. With
    no admission ever heard, the answer stays a fast 503 (test_gateway_http)."""
    from perigee.natsd import NatsServer
    from tests.unit.gateway.test_gateway_migration import OUT as SERVED
    from tests.unit.gateway.test_gateway_migration import serve_the_rest

    with NatsServer() as server:  # a private server: nobody subscribes perigee.requests
        nc_gw, nc_b = await nats.connect(server.url), await nats.connect(server.url)
        gw = await Gateway(
            GatewayConfig(port=0, sweep_interval_s=0, durable_intake=False), nc_gw, tokenizer=TOK
        ).start()
        try:
            p = Presence(kind="admission", name="admission", incarnation=1, interval_s=0.5)
            await nc_b.publish(subjects.presence("admission", "admission"), encode(p))
            await until(lambda: gw.router.control.known("admission"))
            body = {"prompt": "hi", "max_tokens": len(SERVED), "stream": True, "ignore_eos": True}
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
                url = f"http://127.0.0.1:{gw.port}/v1/completions"
                post = asyncio.ensure_future(http.post(url, json=body).__aenter__())
                await until(lambda: gw.router.resends_unanswered >= 1)
                b = await FakeBackend(nc_b, serve_nothing).start()  # admission is back
                req, reply = await asyncio.wait_for(b.requests.get(), 10)
                await serve_the_rest(b, reply, req, resumed=0)
                async with await asyncio.wait_for(post, 10) as r:
                    assert r.status == 200
                    chunks, done = await read_sse(r)
            assert done
            assert "".join(c["choices"][0]["text"] for c in chunks if c.get("choices")) == (
                TOK.decode(SERVED)
            )
        finally:
            await gw.close()
            await nc_gw.close()
            await nc_b.close()
