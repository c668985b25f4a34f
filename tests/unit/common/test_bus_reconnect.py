"""A NATS server that dies loses what was in flight through it: a client that
reconnects says so (services.common.bus.connect), and the gateway resumes every request
it has in flight from the tokens its client has (services.gateway.replies), not counted
against --migration-limit. Real nats-servers; a fake backend plays the workers."""

import asyncio

import nats
import pytest

from bus_schemas import subjects
from bus_schemas.codec import decode, encode
from bus_schemas.control import BusReconnected
from bus_schemas.requests import Accepted, Finished, Tokens
from perigee.natsd import NatsCluster
from services.common import bus
from services.common.clock import ManualClock
from services.gateway.server import GatewayConfig
from tests.unit.gateway.test_gateway_http import (
    TOK,
    FakeBackend,
    quiet_backend_gateway,
    read_sse,
    until,
)

OUT = TOK.encode("one two three four five six", add_bos=False)


async def test_a_client_that_reconnects_announces_it():
    with NatsCluster(2) as cluster:
        a, b = cluster.servers
        nc = await bus.connect(a.url, name="decode-decode-7")  # learns of b from a
        watcher = await nats.connect(b.url)
        got = asyncio.Queue()
        await watcher.subscribe(subjects.BUS_RECONNECTED, cb=got.put)
        await watcher.flush()

        async def discovered() -> None:
            while len(nc.servers) < 2:
                await asyncio.sleep(0.02)

        await asyncio.wait_for(discovered(), 30)
        a.kill()
        msg = await asyncio.wait_for(got.get(), 30)
        note = decode(msg.data, BusReconnected)
        assert note.client == "decode-decode-7" and note.server.endswith(f":{b.port}")
        assert msg.subject == subjects.bus_reconnected("client", "decode-decode-7")
        await nc.close()
        await watcher.close()


@pytest.fixture
async def env(nats_url):
    cfg = GatewayConfig(
        port=0,
        durable_intake=False,  # the fake admission is on core NATS
        max_prompt_tokens=64,
        max_tokens_limit=100,
        max_model_len=128,
        dead_after_s=2.0,
        request_timeout_s=10.0,
        sweep_interval_s=0,
        migration_limit=0,
    )  # even with migration off
    async with quiet_backend_gateway(nats_url, cfg, ManualClock()) as (gw, backend, http):
        yield gw, backend, http


async def send(b: FakeBackend, reply: str, *events) -> None:
    for ev in events:
        await b.nc.publish(reply, encode(ev))
    await b.nc.flush()


async def test_a_bus_loss_resumes_the_request_from_the_tokens_its_client_has(env):
    gw, b, http = env
    url = f"http://127.0.0.1:{gw.port}/v1/completions"
    body = {
        "prompt": "hi",
        "max_tokens": len(OUT),
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    post = asyncio.ensure_future(http.post(url, json=body).__aenter__())
    first, reply = await asyncio.wait_for(b.requests.get(), 5)
    rid = first.request_id
    await send(
        b,
        reply,
        Accepted(request_id=rid, prefill_instance="p0", decode_instance="d0"),
        Tokens(request_id=rid, token_ids=OUT[:2], index=0, from_prefill=True),
    )
    async with await asyncio.wait_for(post, 5) as r:
        # Tokens 2.. went through the server that died; the decode worker reconnects.
        await b.nc.publish(
            subjects.bus_reconnected("worker", "d0"),
            encode(BusReconnected(client="decode-d0")),
        )
        again, reply2 = await asyncio.wait_for(b.requests.get(), 5)
        cancel = await asyncio.wait_for(b.cancels.get(), 5)
        assert cancel.request_id == rid
        assert again.request_id == f"{rid}-m1" and reply2 != reply
        assert again.prompt_token_ids == [*first.prompt_token_ids, *OUT[:2]]
        assert again.sampling.max_tokens == len(OUT) - 2
        assert again.migration.dead_instance == ""  # nobody died: no instance excluded
        aid = again.request_id
        await send(
            b,
            reply2,
            Accepted(request_id=aid, prefill_instance="p0", decode_instance="d0"),
            Tokens(request_id=aid, token_ids=OUT[2:], index=0),
            Finished(
                request_id=aid,
                finish_reason="length",
                prompt_tokens=len(again.prompt_token_ids),
                completion_tokens=len(OUT) - 2,
                cached_tokens=0,
            ),
        )
        chunks, done = await read_sse(r)
    assert done
    text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    assert text == TOK.decode(OUT)
    assert chunks[-1]["usage"]["completion_tokens"] == len(OUT)


async def test_a_bus_loss_with_nothing_in_flight_resends_nothing(env):
    gw, b, _ = env
    gw.router.bus_settle_s = 0.0
    await b.nc.publish(
        subjects.bus_reconnected("worker", "d0"), b"not a notice"
    )  # bad input: ignored
    await b.nc.publish(
        subjects.bus_reconnected("store", "p0"), encode(BusReconnected(client="store-p0"))
    )
    await b.nc.flush()
    await until(lambda: gw.router.bus_passes == 1)  # the notice came and its pass ran
    assert gw.router.migrations == 0 and b.requests.empty()


async def test_a_burst_of_notices_resends_a_request_once(env):
    """Every client of the dead server reconnects within moments: one resume pass."""
    gw, b, http = env
    gw.router.bus_settle_s = 2.0  # far longer than the burst takes to arrive
    url = f"http://127.0.0.1:{gw.port}/v1/completions"
    body = {"prompt": "hi", "max_tokens": len(OUT), "stream": True, "ignore_eos": True}
    post = asyncio.ensure_future(http.post(url, json=body).__aenter__())
    first, reply = await asyncio.wait_for(b.requests.get(), 5)
    rid = first.request_id
    await send(
        b,
        reply,
        Accepted(request_id=rid, prefill_instance="p0", decode_instance="d0"),
        Tokens(request_id=rid, token_ids=OUT[:1], index=0, from_prefill=True),
    )
    async with await asyncio.wait_for(post, 5) as r:
        for kind, who in (
            ("worker", "d0"),
            ("store", "d0"),
            ("gateway", "gateway"),
            ("conductor", "conductor-0"),
        ):
            await b.nc.publish(
                subjects.bus_reconnected(kind, who), encode(BusReconnected(client=who))
            )
        await b.nc.flush()
        again, reply2 = await asyncio.wait_for(b.requests.get(), 10)
        assert again.request_id == f"{rid}-m1"
        assert gw.router.migrations == 1 and gw.router.bus_passes == 1
        aid = again.request_id
        await send(
            b,
            reply2,
            Tokens(request_id=aid, token_ids=OUT[1:], index=0),
            Finished(
                request_id=aid,
                finish_reason="length",
                prompt_tokens=len(again.prompt_token_ids),
                completion_tokens=len(OUT) - 1,
                cached_tokens=0,
            ),
        )
        chunks, done = await read_sse(r)
    assert done and b.requests.empty()
    assert "".join(c["choices"][0]["text"] for c in chunks if c.get("choices")) == TOK.decode(OUT)


async def test_a_gap_in_the_stream_is_never_shown_the_request_goes_on_instead(env):
    """Tokens 1-2 were lost on the bus: token 3 (and a Finished counting 6) would cut
    them out of the stream. The request goes on from token 1 instead."""
    gw, b, http = env
    url = f"http://127.0.0.1:{gw.port}/v1/completions"
    body = {"prompt": "hi", "max_tokens": len(OUT), "stream": True, "ignore_eos": True}
    post = asyncio.ensure_future(http.post(url, json=body).__aenter__())
    first, reply = await asyncio.wait_for(b.requests.get(), 5)
    rid = first.request_id
    await send(
        b,
        reply,
        Accepted(request_id=rid, prefill_instance="p0", decode_instance="d0"),
        Tokens(request_id=rid, token_ids=OUT[:1], index=0, from_prefill=True),
    )
    async with await asyncio.wait_for(post, 5) as r:
        await send(
            b,
            reply,
            Tokens(request_id=rid, token_ids=OUT[3:], index=3),
            Finished(
                request_id=rid,
                finish_reason="length",
                prompt_tokens=3,
                completion_tokens=len(OUT),
                cached_tokens=0,
            ),
        )
        again, reply2 = await asyncio.wait_for(b.requests.get(), 5)
        assert again.prompt_token_ids == [*first.prompt_token_ids, *OUT[:1]]
        aid = again.request_id
        await send(
            b,
            reply2,
            Tokens(request_id=aid, token_ids=OUT[1:], index=0),
            Finished(
                request_id=aid,
                finish_reason="length",
                prompt_tokens=len(again.prompt_token_ids),
                completion_tokens=len(OUT) - 1,
                cached_tokens=0,
            ),
        )
        chunks, done = await read_sse(r)
    assert done
    assert "".join(c["choices"][0]["text"] for c in chunks if c.get("choices")) == TOK.decode(OUT)
    assert gw.router.migrations == 1


async def _one_in_flight(gw, b, http):
    url = f"http://127.0.0.1:{gw.port}/v1/completions"
    body = {"prompt": "hi", "max_tokens": len(OUT), "stream": True, "ignore_eos": True}
    post = asyncio.ensure_future(http.post(url, json=body).__aenter__())
    first, reply = await asyncio.wait_for(b.requests.get(), 5)
    rid = first.request_id
    await send(
        b,
        reply,
        Accepted(request_id=rid, prefill_instance="p0", decode_instance="d0"),
        Tokens(request_id=rid, token_ids=OUT[:1], index=0, from_prefill=True),
    )
    return post, rid


async def notice(b, kind: str, who: str) -> None:
    await b.nc.publish(subjects.bus_reconnected(kind, who), encode(BusReconnected(client=who)))
    await b.nc.flush()


async def test_a_notice_resumes_only_the_requests_its_sender_could_have_dropped(env):
    """Another worker, another node's store, another gateway: their losses are not this
    request's; its own decode instance's store (by the node its load reports name) is."""
    gw, b, http = env
    gw.router.bus_settle_s = 0.0
    await b.load("p0", "d0")  # both report node n0
    await until(lambda: gw.router.nodes.get("d0") == "n0")
    post, rid = await _one_in_flight(gw, b, http)
    async with await asyncio.wait_for(post, 5):
        # In order on one connection: the other gateway's notice (no pass of its own)
        # is taken before the worker's, whose pass would resume the request if it
        # counted.
        await notice(b, "gateway", "another-gateway")
        for i, (kind, who) in enumerate((("worker", "d7"), ("store", "n9")), start=1):
            await notice(b, kind, who)
            await until(lambda i=i: gw.router.bus_passes == i)
        assert gw.router.migrations == 0 and b.requests.empty()
        await notice(b, "store", "n0")
        again, _ = await asyncio.wait_for(b.requests.get(), 5)
        assert again.request_id == f"{rid}-m1" and gw.router.migrations == 1


async def test_resumes_after_bus_losses_are_bounded_per_request(env):
    """A loop of notices must not re-run a request's prefill for ever."""
    from services.gateway.replies import MAX_BUS_RESUMES

    gw, b, http = env
    gw.router.bus_settle_s = 0.0
    post, rid = await _one_in_flight(gw, b, http)
    async with await asyncio.wait_for(post, 5):
        for n in range(1, MAX_BUS_RESUMES + 3):
            await notice(b, "gateway", gw.gateway_id)
            await until(lambda n=n: gw.router.bus_passes == n)
        resent = []
        while not b.requests.empty():
            resent.append((await b.requests.get())[0].request_id)
        assert len(resent) == MAX_BUS_RESUMES
        assert gw.router.migrations == MAX_BUS_RESUMES
