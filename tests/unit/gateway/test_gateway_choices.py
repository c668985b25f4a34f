"""``n`` > 1 at the gateway (services.gateway.choices): a fake backend answers as the
decode instance does (Tokens tagged with their sequence, interleaved, one Finished with
each sequence's reason and count); the gateway, on a real port and a real nats-server,
assembles n choices, streamed and not, for chat and completions."""

import asyncio
import json

import aiohttp
import nats
import pytest

from bus_schemas.requests import Accepted, Finished, GenerateRequest, Tokens
from services.common.clock import ManualClock
from services.gateway.server import Gateway, GatewayConfig
from tests.unit.gateway.test_gateway_http import (
    TOK,
    Env,
    FakeBackend,
    read_sse,
    serve_accept_then_silence,
    until,
)

TEXTS = ["Hello there!", "Good day, friend.", "Hi! and more"]
SEQ_IDS = [TOK.encode(t, add_bos=False) for t in TEXTS]


async def serve_n(b: FakeBackend, req: GenerateRequest, reply: str) -> None:
    rid, n = req.request_id, req.sampling.n
    await b.send(reply, Accepted(request_id=rid, prefill_instance="p0", decode_instance="d0"))
    # sequence 0's first token from prefill, then the sequences interleaved token by token
    sent = [0] * n
    for step in range(max(len(t) for t in SEQ_IDS[:n])):
        for i in range(n):
            ids = SEQ_IDS[i]
            if step < len(ids):
                await b.send(
                    reply, Tokens(request_id=rid, token_ids=[ids[step]], index=step, seq=i)
                )
                sent[i] += 1
    # sequence 1 also ended on EOS, which the client never sees but usage counts
    await b.send(reply, Tokens(request_id=rid, token_ids=[TOK.eos_id], index=sent[1], seq=1))
    sent[1] += 1
    await b.send(
        reply,
        Finished(
            request_id=rid,
            finish_reason="length",
            prompt_tokens=len(req.prompt_token_ids),
            completion_tokens=sum(sent),
            cached_tokens=0,
            seq_finish=["length", "stop", "length"][:n],
            seq_tokens=sent,
        ),
    )


@pytest.fixture
async def nenv(nats_url):
    cfg = GatewayConfig(
        port=0,
        durable_intake=False,
        max_prompt_tokens=64,
        max_tokens_limit=100,
        max_model_len=128,
        dead_after_s=2.0,
        request_timeout_s=10.0,
        sweep_interval_s=0,
        migration_limit=3,  # n > 1 is failed even where a request would be migrated
    )
    clock = ManualClock()
    nc_gw = await nats.connect(nats_url)
    nc_be = await nats.connect(nats_url)
    gw = await Gateway(cfg, nc_gw, tokenizer=TOK, clock=clock).start()
    backend = await FakeBackend(nc_be, serve_n).start()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
        yield Env(gw, backend, http, clock)
    await gw.close()
    await nc_gw.close()
    await nc_be.close()


def _usage_tokens() -> int:
    return sum(len(ids) for ids in SEQ_IDS) + 1  # sequence 1's EOS


@pytest.mark.parametrize("chat", [False, True])
async def test_n_choices_non_stream(nenv, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"n": 3, "seed": 3, "max_tokens": 20}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    async with nenv.post(path, body) as r:
        assert r.status == 200
        out = await r.json()
    req, _ = nenv.backend.requests.get_nowait()
    assert req.sampling.n == 3 and req.sampling.seed == 3
    got = sorted(out["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in got] == [0, 1, 2]
    texts = [c["message"]["content"] if chat else c["text"] for c in got]
    assert texts == TEXTS
    assert [c["finish_reason"] for c in got] == ["length", "stop", "length"]
    assert out["usage"]["completion_tokens"] == _usage_tokens()


@pytest.mark.parametrize("chat", [False, True])
async def test_n_choices_stream(nenv, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"n": 3, "stream": True, "stream_options": {"include_usage": True}}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    async with nenv.post(path, body) as r:
        assert r.status == 200
        chunks, done = await read_sse(r)
    assert done
    texts, finishes = ["", "", ""], [None, None, None]
    for ch in chunks[:-1]:
        [c] = ch["choices"]
        assert finishes[c["index"]] is None  # nothing after a choice's finish
        texts[c["index"]] += (c["delta"].get("content", "") if chat else c["text"]) or ""
        finishes[c["index"]] = c["finish_reason"]
    assert texts == TEXTS
    assert finishes == ["length", "stop", "length"]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == _usage_tokens()


async def test_a_stop_string_ends_its_choice_only(nenv):
    async with nenv.post("/v1/completions", {"prompt": "hi", "n": 3, "stop": ["!"]}) as r:
        out = await r.json()
    got = sorted(out["choices"], key=lambda c: c["index"])
    assert [c["text"] for c in got] == ["Hello there", "Good day, friend.", "Hi"]
    assert [c["finish_reason"] for c in got] == ["stop", "stop", "stop"]


async def test_every_choice_on_a_stop_string_cancels_the_backend(nenv):
    async def serve_forever(b, req, reply):
        await serve_accept_then_silence(b, req, reply)
        for i in range(2):
            await b.send(
                reply, Tokens(request_id=req.request_id, token_ids=SEQ_IDS[0], index=0, seq=i)
            )

    nenv.set_behaviour(serve_forever)
    async with nenv.post("/v1/completions", {"prompt": "hi", "n": 2, "stop": ["!"]}) as r:
        out = await r.json()
    assert [c["text"] for c in out["choices"]] == ["Hello there", "Hello there"]
    req, _ = nenv.backend.requests.get_nowait()
    async with asyncio.timeout(5):
        cancel = await nenv.backend.cancels.get()
    assert cancel.request_id == req.request_id and cancel.reason == "stop string"


async def test_decode_death_fails_n_request_with_503_not_migrated(nenv):
    async def serve_some(b, req, reply):
        await serve_accept_then_silence(b, req, reply)
        await b.send(
            reply, Tokens(request_id=req.request_id, token_ids=SEQ_IDS[0][:2], index=0, seq=0)
        )
        await b.send(
            reply, Tokens(request_id=req.request_id, token_ids=SEQ_IDS[1][:2], index=0, seq=1)
        )

    nenv.set_behaviour(serve_some)
    await nenv.backend.load("p0", "d0")
    await until(lambda: nenv.gw.watchdog.liveness.known("d0"))
    async with nenv.post("/v1/completions", {"prompt": "hi", "n": 2, "stream": True}) as r:
        assert r.status == 200
        await r.content.readuntil(b"\n\n")
        req, _ = nenv.backend.requests.get_nowait()
        await until(lambda: nenv.gw.watchdog.stage(req.request_id) == "decode")
        nenv.clock.advance(2.5)  # d0 reported nothing since
        assert nenv.gw.router.sweep() == 1
        chunks, done = await read_sse(r)
    assert not done
    err = chunks[-1]["error"]
    assert err["code"] == "service_unavailable"
    assert "n > 1 is not migrated" in err["message"]
    assert nenv.gw.router.migrations == 0
    assert nenv.backend.requests.empty()  # nothing was resent


async def test_tools_with_n_are_refused(nenv):
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "n": 2,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "tool_choice": "required",
    }
    async with nenv.post("/v1/chat/completions", json.dumps(body).encode()) as r:
        assert r.status == 400
        assert (await r.json())["error"]["param"] == "n"


async def test_a_death_before_any_token_sends_the_n_request_again(nenv):
    async def first_dies(b, req, reply):
        if req.migration is None:
            await serve_accept_then_silence(b, req, reply)
        else:
            await serve_n(b, req, reply)

    nenv.set_behaviour(first_dies)
    await nenv.backend.load("p0", "d0")
    await until(lambda: nenv.gw.watchdog.liveness.known("p0"))
    task = asyncio.ensure_future(
        nenv.post("/v1/completions", {"prompt": "hi", "n": 3}).__aenter__()
    )
    req, _ = await asyncio.wait_for(nenv.backend.requests.get(), 5)
    await until(lambda: nenv.gw.watchdog.stage(req.request_id) == "prefill")
    nenv.clock.advance(2.5)  # p0 reported nothing since: it died before the first token
    assert nenv.gw.router.sweep() == 1
    r = await asyncio.wait_for(task, 10)
    assert r.status == 200
    out = await r.json()
    r.release()
    again, _ = nenv.backend.requests.get_nowait()
    assert again.migration is not None and again.sampling.n == 3
    assert again.prompt_token_ids == req.prompt_token_ids  # nothing to resume
    assert [c["text"] for c in sorted(out["choices"], key=lambda c: c["index"])] == TEXTS
    assert nenv.gw.router.migrations == 1
