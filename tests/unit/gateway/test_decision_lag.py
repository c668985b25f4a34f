"""The control plane's lag (services.gateway.decision_lag): a new request gets 429 +
Retry-After while the oldest request the gateway sent has waited for its placement
longer than --max-decision-lag-ms; an answer of any kind ends the wait; off by default.

On a real nats-server with a fake admission that holds requests unanswered until told;
time is the gateway's injected clock, moved by hand."""

import asyncio

import aiohttp
import nats
import pytest

from bus_schemas.requests import Accepted
from services.common.clock import ManualClock
from services.gateway.decision_lag import DecisionLag
from services.gateway.server import Gateway, GatewayConfig
from tests.unit.gateway.test_gateway_http import TOK, FakeBackend, until

HI = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_oldest_undecided_request_sets_the_age():
    lag = DecisionLag()
    assert lag.age(5.0) == 0.0
    lag.sent("a", 1.0)
    lag.sent("b", 2.0)
    lag.sent("a", 3.0)  # a resend keeps the first send's time
    assert lag.age(4.0) == 3.0 and len(lag) == 2
    lag.decided("a")
    assert lag.age(4.0) == 2.0
    lag.decided("b")
    lag.decided("never-sent")
    assert lag.age(4.0) == 0.0 and len(lag) == 0


@pytest.fixture
async def make(nats_url):
    made = []

    async def build(max_decision_lag_s: float):
        clock = ManualClock()
        cfg = GatewayConfig(
            port=0,
            durable_intake=False,
            max_prompt_tokens=64,
            max_tokens_limit=100,
            max_model_len=128,
            sweep_interval_s=0,
            migration_limit=0,
            max_decision_lag_s=max_decision_lag_s,
        )
        nc_gw, nc_be = await nats.connect(nats_url), await nats.connect(nats_url)
        gw = await Gateway(cfg, nc_gw, tokenizer=TOK, clock=clock).start()

        async def hold(b, req, reply):  # the control plane is behind: no answer yet
            return None

        backend = await FakeBackend(nc_be, hold).start()
        http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20))
        made.append((gw, http, [nc_gw, nc_be]))
        return gw, backend, http, clock

    yield build
    for gw, http, ncs in made:
        await http.close()
        await gw.close(0.5)
        for nc in ncs:
            await nc.close()


async def post(http, gw):
    async with http.post(f"http://127.0.0.1:{gw.port}/v1/chat/completions", json=HI) as r:
        return r.status, dict(r.headers), await r.json()


async def test_a_lagging_control_plane_answers_429(make):
    gw, backend, http, clock = await make(max_decision_lag_s=0.05)
    held = asyncio.ensure_future(post(http, gw))
    first, reply = await backend.requests.get()
    clock.advance(0.04)  # within the limit: the next request is sent too
    second = asyncio.ensure_future(post(http, gw))
    await backend.requests.get()
    clock.advance(0.02)  # the oldest has now waited 0.06 s
    status, headers, body = await post(http, gw)
    assert status == 429 and headers["Retry-After"] == "1"
    assert body["error"]["code"] == "rate_limit_exceeded"
    assert "behind its placement decisions" in body["error"]["message"]
    assert backend.requests.empty()  # turned away before it reached the bus
    # The oldest is placed: the second (0.02 s old) is the oldest now, within the limit.
    await backend.send(
        reply,
        Accepted(request_id=first.request_id, prefill_instance="p0", decode_instance="d0"),
    )
    await until(lambda: len(gw.router.undecided) == 1)
    third = asyncio.ensure_future(post(http, gw))
    await backend.requests.get()  # sent, not refused
    for t in (held, second, third):
        t.cancel()
    await asyncio.gather(held, second, third, return_exceptions=True)


async def test_off_by_default(make):
    gw, backend, http, clock = await make(max_decision_lag_s=0.0)
    held = asyncio.ensure_future(post(http, gw))
    await backend.requests.get()
    clock.advance(3600.0)
    second = asyncio.ensure_future(post(http, gw))
    await backend.requests.get()  # an hour behind, and still sent
    for t in (held, second):
        t.cancel()
    await asyncio.gather(held, second, return_exceptions=True)
