"""The gateway in-process on a real port, a real nats-server, and a fake backend that
answers GenerateRequests on their reply subject the way admission/conductor/decode do."""

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import nats
import pytest
from aiohttp import http_writer, web
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bus_schemas import subjects
from bus_schemas.codec import decode, encode
from bus_schemas.control import Presence
from bus_schemas.load import DecodeLoad, PrefillLoad
from bus_schemas.requests import (
    Accepted,
    CancelRequest,
    Error,
    ErrorCode,
    Finished,
    GenerateRequest,
    Tokens,
)
from services.common.clock import ManualClock
from services.common.hashing import block_hashes
from services.common.tokenizer import Tokenizer
from services.gateway.server import Gateway, GatewayConfig
from tracing import setup_tracing

TOK = Tokenizer.from_dir()
OUT_TEXT = "Hello, world! 你好 😀"
OUT_IDS = TOK.encode(OUT_TEXT, add_bos=False)
CACHED = 32

Behaviour = Callable[["FakeBackend", GenerateRequest, str], Awaitable[None]]


class FakeBackend:
    """Subscribes perigee.requests and perigee.cancel; ``behaviour`` answers each request."""

    def __init__(self, nc, behaviour: Behaviour) -> None:
        self.nc = nc
        self.behaviour = behaviour
        self.requests: asyncio.Queue = asyncio.Queue()
        self.cancels: asyncio.Queue = asyncio.Queue()
        self.headers: list[dict] = []
        self.cancel_headers: list[dict] = []

    async def start(self) -> "FakeBackend":
        async def on_req(msg):
            req = decode(msg.data, GenerateRequest)
            self.headers.append(dict(msg.headers or {}))
            await self.requests.put((req, msg.reply))
            await self.behaviour(self, req, msg.reply)

        async def on_cancel(msg):
            self.cancel_headers.append(dict(msg.headers or {}))
            await self.cancels.put(decode(msg.data, CancelRequest))

        await self.nc.subscribe(subjects.REQUESTS, cb=on_req)
        await self.nc.subscribe(subjects.CANCEL, cb=on_cancel)
        # Twice: nats-py's flush() PING can overtake a SUB still in its pending buffer.
        await self.nc.flush()
        await self.nc.flush()
        return self

    async def send(self, reply: str, ev) -> None:
        await self.nc.publish(reply, encode(ev))

    async def present(self) -> None:
        """Beat as an admission and a conductor do (services.common.presence)."""
        for kind in ("admission", "conductor"):
            p = Presence(kind=kind, name=kind, incarnation=1, interval_s=0.5)
            await self.nc.publish(subjects.presence(kind, kind), encode(p))
        await self.nc.flush()

    async def load(self, prefill: str = "p0", decode_: str = "d0") -> None:
        await self.nc.publish(
            subjects.load_report("prefill", prefill),
            encode(
                PrefillLoad(
                    instance=prefill,
                    node="n0",
                    queue_len=0,
                    queued_tokens=0,
                    queued_work_s=0.0,
                    ts=0.0,
                )
            ),
        )
        await self.nc.publish(
            subjects.load_report("decode", decode_),
            encode(
                DecodeLoad(
                    instance=decode_,
                    node="n0",
                    batch_size=0,
                    waiting=0,
                    max_batch=8,
                    kv_tokens=0,
                    step_time_s=0.0,
                    ts=0.0,
                )
            ),
        )
        await self.nc.flush()


async def serve_ok(b: FakeBackend, req: GenerateRequest, reply: str, bundled: bool = False) -> None:
    """Accepted, the first token, the rest, Finished; ``bundled``: the rest inside
    Finished, as a decode worker sends them to a client that asked (finish_with_tokens)."""
    rid = req.request_id
    await b.send(
        reply,
        Accepted(request_id=rid, prefill_instance="p0", decode_instance="d0", cached_tokens=CACHED),
    )
    await b.send(reply, Tokens(request_id=rid, token_ids=OUT_IDS[:1], index=0))
    rest = Tokens(request_id=rid, token_ids=OUT_IDS[1:] + [TOK.eos_id], index=1)
    if not bundled:
        await b.send(reply, rest)
    await b.send(
        reply,
        Finished(
            request_id=rid,
            finish_reason="stop",
            prompt_tokens=len(req.prompt_token_ids),
            completion_tokens=len(OUT_IDS) + 1,
            cached_tokens=CACHED,
            tokens=rest if bundled else None,
        ),
    )


async def serve_ok_bundled(b: FakeBackend, req: GenerateRequest, reply: str) -> None:
    await serve_ok(b, req, reply, bundled=True)


async def serve_reject(b: FakeBackend, req: GenerateRequest, reply: str) -> None:
    await b.send(
        reply,
        Error(
            request_id=req.request_id,
            code=ErrorCode.REJECTED,
            message="overloaded",
            retry_after_s=1.2,
        ),
    )


async def serve_accept_then_silence(b: FakeBackend, req: GenerateRequest, reply: str) -> None:
    await b.send(
        reply, Accepted(request_id=req.request_id, prefill_instance="p0", decode_instance="d0")
    )


async def serve_first_token_then_silence(b: FakeBackend, req: GenerateRequest, reply: str) -> None:
    await serve_accept_then_silence(b, req, reply)
    await b.send(reply, Tokens(request_id=req.request_id, token_ids=OUT_IDS[:3], index=0))


async def serve_tokens_then_429(b: FakeBackend, req: GenerateRequest, reply: str) -> None:
    await serve_first_token_then_silence(b, req, reply)
    await serve_reject(b, req, reply)


async def serve_nothing(b: FakeBackend, req: GenerateRequest, reply: str) -> None:
    return None


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait for a condition another task makes true (not a timing assertion)."""
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.005)


class Env:
    def __init__(
        self, gw: Gateway, backend: FakeBackend, http: aiohttp.ClientSession, clock
    ) -> None:
        self.gw, self.backend, self.http, self.clock = gw, backend, http, clock
        self.base = f"http://127.0.0.1:{gw.port}"

    def post(self, path: str, body, **kw):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        return self.http.post(
            self.base + path, data=data, headers={"Content-Type": "application/json"}, **kw
        )

    def set_behaviour(self, behaviour: Behaviour) -> None:
        self.backend.behaviour = behaviour


@contextlib.asynccontextmanager
async def quiet_backend_gateway(
    nats_url: str, cfg: GatewayConfig, clock: ManualClock
) -> AsyncIterator[tuple[Gateway, "FakeBackend", aiohttp.ClientSession]]:
    """A gateway on ``clock`` before a fake admission that answers nothing by itself (the
    test plays the backend), and an HTTP client."""
    nc_gw, nc_be = await nats.connect(nats_url), await nats.connect(nats_url)
    gw = await Gateway(cfg, nc_gw, tokenizer=TOK, clock=clock).start()
    backend = await FakeBackend(nc_be, serve_nothing).start()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
            yield gw, backend, http
    finally:
        await gw.close()
        await nc_gw.close()
        await nc_be.close()


@pytest.fixture
async def env(nats_url):
    clock = ManualClock()
    cfg = GatewayConfig(
        port=0,
        durable_intake=False,  # the fake admission is on core NATS
        max_prompt_tokens=64,
        max_tokens_limit=100,
        max_model_len=128,
        max_body_bytes=4096,
        dead_after_s=2.0,
        request_timeout_s=10.0,
        sweep_interval_s=0,
        migration_limit=0,  # a dead worker fails its requests (migration: test_gateway_migration)
    )
    nc_gw = await nats.connect(nats_url)
    nc_be = await nats.connect(nats_url)
    gw = await Gateway(cfg, nc_gw, tokenizer=TOK, clock=clock).start()
    backend = await FakeBackend(nc_be, serve_ok).start()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
        yield Env(gw, backend, http, clock)
    await gw.close()
    await nc_gw.close()
    await nc_be.close()


async def read_sse(resp) -> tuple[list, bool]:
    """(decoded data chunks, whether [DONE] came)."""
    raw = (await resp.read()).decode()
    assert raw.endswith("\n\n")
    chunks, done = [], False
    for block in raw.split("\n\n")[:-1]:
        assert block.startswith("data: ")
        payload = block[len("data: ") :]
        if payload == "[DONE]":
            done = True
        else:
            assert not done
            chunks.append(json.loads(payload))
    return chunks, done


def usage_of(prompt_tokens: int) -> dict:
    c = len(OUT_IDS) + 1
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": c,
        "total_tokens": prompt_tokens + c,
        "prompt_tokens_details": {"cached_tokens": CACHED},
    }


async def test_completion_non_stream(env, monkeypatch):
    exporter = InMemorySpanExporter()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    provider = setup_tracing("test")
    # The gateway's spans go to the global provider: it must be this one, or they vanish.
    assert trace.get_tracer_provider() is provider
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    prompt = "The quick brown fox " * 5
    body = {
        "model": "tiny-llama",
        "prompt": prompt,
        "max_tokens": 20,
        "temperature": 0.5,
        "seed": 7,
        "stop_token_ids": [5],
        "ignore_eos": True,
        "user": "x",
        "frobnicate": 1,
    }
    async with env.post("/v1/completions", body) as r:
        assert r.status == 200
        out = await r.json()
    req, reply = env.backend.requests.get_nowait()
    ids = TOK.encode(prompt)
    assert req.prompt_token_ids == ids and ids[0] == 1
    assert req.block_size == 32 and req.block_hashes == block_hashes(ids, 32)
    assert reply == req.reply_subject == env.gw.router.reply_subject(req.request_id)
    # perigee.gw.<gateway>.<request id>.<nonce>: the nonce makes it a capability
    prefix = f"perigee.gw.{env.gw.gateway_id}.{req.request_id}."
    assert reply.startswith(prefix) and len(reply) - len(prefix) >= 16
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.seed, s.stop_token_ids, s.ignore_eos) == (
        20,
        0.5,
        7,
        [5],
        True,
    )
    assert req.model == "tiny-llama" and req.arrival_ts > 0
    assert req.request_id.startswith("cmpl-") and len(req.request_id) == 5 + 32
    assert out == {
        "id": req.request_id,
        "object": "text_completion",
        "created": out["created"],
        "model": "tiny-llama",
        "choices": [{"index": 0, "text": OUT_TEXT, "logprobs": None, "finish_reason": "stop"}],
        "usage": usage_of(len(ids)),
    }
    assert "traceparent" in env.backend.headers[0]
    provider.force_flush()
    [span] = [sp for sp in exporter.get_finished_spans() if sp.name == "gateway.request"]
    a = span.attributes
    assert a["gen_ai.request.model"] == "tiny-llama"
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (
        len(ids),
        len(OUT_IDS) + 1,
    )


async def test_completion_token_prompt_stream_with_usage(env):
    body = {
        "prompt": [[1, 300, 301, 302]],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with env.post("/v1/completions", body) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        chunks, done = await read_sse(r)
    req, _ = env.backend.requests.get_nowait()
    assert req.prompt_token_ids == [1, 300, 301, 302] and req.sampling.max_tokens == 16
    assert done
    assert all(c["object"] == "text_completion" and c["id"] == req.request_id for c in chunks)
    *texts, last, use = chunks
    assert "".join(c["choices"][0]["text"] for c in texts) == OUT_TEXT
    assert all(c["choices"][0]["finish_reason"] is None and c["usage"] is None for c in texts)
    assert last["choices"] == [{"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}]
    assert use["choices"] == [] and use["usage"] == usage_of(4)


async def test_last_tokens_inside_finished_reach_the_client(env):
    # The gateway asks the decode worker for them there (one bus message fewer); the
    # client's answer is the same as from separate Tokens and Finished events.
    got = {}
    for name, behaviour in (("apart", serve_ok), ("bundled", serve_ok_bundled)):
        env.set_behaviour(behaviour)
        async with env.post("/v1/completions", {"prompt": "hi"}) as r:
            assert r.status == 200
            out = await r.json()
        async with env.post("/v1/completions", {"prompt": "hi", "stream": True}) as r:
            chunks, done = await read_sse(r)
        req, _ = env.backend.requests.get_nowait()
        assert req.finish_with_tokens and done
        streamed = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        got[name] = (out["choices"], out["usage"], streamed)
    assert got["bundled"] == got["apart"] and got["apart"][0][0]["text"] == OUT_TEXT
    assert got["apart"][2] == OUT_TEXT


async def test_chat_non_stream_and_stream(env):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    async with env.post(
        "/v1/chat/completions",
        {"model": "tiny-llama", "messages": msgs, "max_completion_tokens": 9},
    ) as r:
        assert r.status == 200
        out = await r.json()
    req, _ = env.backend.requests.get_nowait()
    ids = TOK.encode_chat(msgs)
    assert req.prompt_token_ids == ids and req.sampling.max_tokens == 9
    assert req.request_id.startswith("chatcmpl-")
    assert out == {
        "id": req.request_id,
        "object": "chat.completion",
        "created": out["created"],
        "model": "tiny-llama",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": OUT_TEXT},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": usage_of(len(ids)),
    }
    body = {"messages": msgs, "stream": True, "stream_options": {"include_usage": True}}
    async with env.post("/v1/chat/completions", body) as r:
        assert r.status == 200
        chunks, done = await read_sse(r)
    req, _ = env.backend.requests.get_nowait()
    assert req.sampling.max_tokens == 100  # chat default: what the context and the limit allow
    assert done and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    *_, last, use = chunks
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-1]) == OUT_TEXT
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "stop"
    assert use["choices"] == [] and use["usage"] == usage_of(len(ids))


async def test_stream_without_usage(env):
    async with env.post("/v1/completions", {"prompt": "hi", "stream": True}) as r:
        chunks, done = await read_sse(r)
    assert done and all("usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_a_streams_last_chunks_go_out_with_its_end(env, monkeypatch):
    """One write for the end: its last chunks, [DONE] and the chunked terminator together
    (each write wakes the client's process)."""
    calls: list[tuple[str, bytes]] = []
    write, write_eof = web.StreamResponse.write, web.StreamResponse.write_eof

    async def spy_write(self, data):
        calls.append(("write", bytes(data)))
        return await write(self, data)

    async def spy_eof(self, data=b""):
        calls.append(("eof", bytes(data)))
        return await write_eof(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", spy_write)
    monkeypatch.setattr(web.StreamResponse, "write_eof", spy_eof)
    for path, body in (
        ("/v1/completions", {"prompt": "hi", "stream": True}),
        ("/v1/completions", {"prompt": "hi", "stream": True, "n": 2}),  # choices.py
    ):
        calls.clear()
        async with env.post(path, body) as r:
            chunks, done = await read_sse(r)
        assert done and chunks[-1]["choices"][0]["finish_reason"] == "stop"
        end = [k for k, _ in calls].index("eof")
        # (aiohttp's own write_eof once the handler returns: a no-op, nothing to send)
        assert all(c == ("eof", b"") for c in calls[end + 1 :]), calls
        assert b"[DONE]" in calls[end][1] and b'"finish_reason":"stop"' in calls[end][1]
        assert all(b"[DONE]" not in d for _, d in calls[:end])


async def test_a_streams_headers_go_out_with_its_first_chunk(env, monkeypatch):
    """The status line and headers leave in the same transport write as the first
    token's chunk: one wake of the client's process for the first token, not two."""
    sent: list[bytes] = []
    write, writelines = http_writer.StreamWriter._write, http_writer.StreamWriter._writelines

    def spy_write(self, chunk):
        sent.append(bytes(chunk))
        return write(self, chunk)

    def spy_writelines(self, chunks):
        sent.append(b"".join(bytes(c) for c in chunks))
        return writelines(self, chunks)

    monkeypatch.setattr(http_writer.StreamWriter, "_write", spy_write)
    monkeypatch.setattr(http_writer.StreamWriter, "_writelines", spy_writelines)
    for path, body in (
        ("/v1/completions", {"prompt": "hi", "stream": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}),
        ("/v1/completions", {"prompt": "hi", "stream": True, "n": 2}),  # choices.py
    ):
        sent.clear()
        async with env.post(path, body) as r:
            assert r.headers["Content-Type"] == "text/event-stream"
            chunks, done = await read_sse(r)
        assert done and chunks
        # (the client's writes go through the same writer class: the request)
        first = next(c for c in sent if c.startswith(b"HTTP/1.1 "))
        assert first.startswith(b"HTTP/1.1 200") and b"\r\n\r\n" in first, sent
        assert b"data: {" in first, sent  # the first chunk rode with the headers


async def stack_ready(env) -> None:
    """An admission, a conductor, a prefill and a decode instance heard, as a gateway
    hears them once its stack is up."""
    await env.backend.present()
    await env.backend.load()
    await until(lambda: not env.gw.router.missing())


async def test_models_and_health(env):
    await stack_ready(env)
    async with env.http.get(env.base + "/v1/models") as r:
        out = await r.json()
    assert out["object"] == "list" and [m["id"] for m in out["data"]] == ["tiny-llama"]
    assert out["data"][0]["object"] == "model"
    async with env.http.get(env.base + "/health") as r:
        assert r.status == 200 and (await r.json())["status"] == "ok"
    async with env.post("/v1/completions", {"prompt": "hi"}) as r:
        assert r.status == 200
    async with env.post("/v1/completions", {"prompt": "hi", "n": 17}) as r:
        assert r.status == 400
    async with env.http.get(env.base + "/metrics") as r:
        text = await r.text()
    # Exact counts are in tests/unit/gateway/test_metrics_gateway.py (the registry is per process).
    assert 'perigee:request_success_total{finished_reason="stop",model_name="tiny-llama"}' in text
    assert 'perigee:request_errors_total{model_name="tiny-llama",status="400"}' in text
    assert "perigee:gateway_requests_in_flight 0.0" in text


async def test_rate_limited_gets_429_with_retry_after(env):
    env.set_behaviour(serve_reject)
    for stream in (False, True):
        async with env.post("/v1/completions", {"prompt": "hi", "stream": stream}) as r:
            assert r.status == 429
            assert r.headers["Retry-After"] == "2"
            err = (await r.json())["error"]
        assert err["type"] == "rate_limit_exceeded" and err["message"] == "overloaded"


async def test_error_after_stream_started_is_an_sse_chunk(env):
    env.set_behaviour(serve_tokens_then_429)
    async with env.post(
        "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True}
    ) as r:
        assert r.status == 200
        chunks, done = await read_sse(r)
    assert not done
    assert chunks[-1]["error"]["type"] == "rate_limit_exceeded"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == TOK.decode(
        OUT_IDS[:3]
    )


async def test_other_backend_errors_keep_their_status(env):
    async def serve_503(b, req, reply):
        await b.send(
            reply,
            Error(request_id=req.request_id, code=ErrorCode.UNAVAILABLE, message="no prefill"),
        )

    env.set_behaviour(serve_503)
    async with env.post("/v1/completions", {"prompt": "hi"}) as r:
        assert r.status == 503
        err = (await r.json())["error"]
    assert err == {
        "message": "no prefill",
        "type": "server_error",
        "param": None,
        "code": "service_unavailable",
    }


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{bad json", 400, None),
        ({"prompt": "hi", "max_tokens": "lots"}, 400, "max_tokens"),
        ({"prompt": "hi", "n": 17}, 400, "n"),
        ({"prompt": list(range(3, 3 + 65))}, 400, "prompt"),  # > max_prompt_tokens
        ({"prompt": "hi", "max_tokens": 101}, 400, "max_tokens"),  # > max_tokens_limit
        ({"prompt": list(range(3, 3 + 60)), "max_tokens": 80}, 400, "prompt"),  # > max_model_len
        ({"prompt": "hi", "model": "gpt-9"}, 404, "model"),
        ({"prompt": "x" * 5000}, 413, None),
    ],
)
async def test_bad_requests(env, body, status, param):
    async with env.post("/v1/completions", body) as r:
        assert r.status == status
        err = (await r.json())["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    assert env.backend.requests.empty()


async def test_chat_n2_and_bad_messages(env):
    for body in ({"messages": [{"role": "user", "content": "x"}], "n": 17}, {"messages": "x"}):
        async with env.post("/v1/chat/completions", body) as r:
            assert r.status == 400


async def test_stop_string_truncates_and_cancels(env):
    async def serve_forever(b, req, reply):
        await serve_accept_then_silence(b, req, reply)
        await b.send(reply, Tokens(request_id=req.request_id, token_ids=OUT_IDS, index=0))

    env.set_behaviour(serve_forever)
    for stream in (False, True):
        async with env.post(
            "/v1/completions", {"prompt": "hi", "stop": ["!", "zzz"], "stream": stream}
        ) as r:
            assert r.status == 200
            if stream:
                chunks, done = await read_sse(r)
                assert done and chunks[-1]["choices"][0]["finish_reason"] == "stop"
                text = "".join(c["choices"][0]["text"] for c in chunks)
            else:
                out = await r.json()
                text = out["choices"][0]["text"]
                assert out["choices"][0]["finish_reason"] == "stop"
        assert text == "Hello, world"
        req, _ = env.backend.requests.get_nowait()
        async with asyncio.timeout(5):
            cancel = await env.backend.cancels.get()
        assert cancel.request_id == req.request_id and cancel.reason == "stop string"


async def test_watchdog_decode_death_mid_stream(env):
    env.set_behaviour(serve_first_token_then_silence)
    await env.backend.load("p0", "d0")
    await until(lambda: env.gw.watchdog.liveness.known("d0"))
    async with env.post("/v1/completions", {"prompt": "hi", "stream": True}) as r:
        assert r.status == 200
        first = await r.content.readuntil(b"\n\n")  # the first token is out: stage is decode
        assert json.loads(first[6:])["choices"][0]["text"] == TOK.decode(OUT_IDS[:3])
        req, _ = env.backend.requests.get_nowait()
        assert env.gw.watchdog.stage(req.request_id) == "decode"
        env.clock.advance(2.5)  # d0 reported nothing since
        assert env.gw.router.sweep() == 1
        chunks, done = await read_sse(r)
    assert not done
    [err] = chunks
    assert err["error"]["code"] == "service_unavailable"
    assert "decode instance d0" in err["error"]["message"]
    async with asyncio.timeout(5):
        cancel = await env.backend.cancels.get()
    assert cancel.request_id == req.request_id


async def test_watchdog_prefill_death_is_http_503(env):
    env.set_behaviour(serve_accept_then_silence)
    await env.backend.load("p0", "d0")
    await until(lambda: env.gw.watchdog.liveness.known("p0"))
    task = asyncio.ensure_future(
        env.post(
            "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}
        ).__aenter__()
    )
    req, _ = await asyncio.wait_for(env.backend.requests.get(), 5)
    await until(lambda: env.gw.watchdog.stage(req.request_id) == "prefill")
    env.clock.advance(2.5)
    assert env.gw.router.sweep() == 1
    r = await asyncio.wait_for(task, 10)
    assert r.status == 503
    err = (await r.json())["error"]
    r.release()
    assert "prefill instance p0" in err["message"] and err["type"] == "server_error"
    async with asyncio.timeout(5):
        assert (await env.backend.cancels.get()).request_id == req.request_id


async def test_request_timeout_is_504(env):
    env.set_behaviour(serve_nothing)
    task = asyncio.ensure_future(
        env.post("/v1/completions", {"prompt": "hi", "stream": True}).__aenter__()
    )
    req, _ = await asyncio.wait_for(env.backend.requests.get(), 5)
    env.clock.advance(10.5)
    await until(lambda: env.gw.router.sweep() == 1 or req.request_id not in env.gw.watchdog)
    r = await asyncio.wait_for(task, 10)
    assert r.status == 504 and (await r.json())["error"]["code"] == "timeout"
    r.release()


async def test_client_disconnect_publishes_cancel(env):
    env.set_behaviour(serve_first_token_then_silence)
    # streaming: read the first chunk, then hang up
    r = await env.post("/v1/completions", {"prompt": "hi", "stream": True}).__aenter__()
    await r.content.readuntil(b"\n\n")
    req, _ = env.backend.requests.get_nowait()
    r.close()
    async with asyncio.timeout(5):
        cancel = await env.backend.cancels.get()
    assert cancel.request_id == req.request_id and cancel.reason == "client disconnected"
    # non-streaming: hang up while the gateway waits for tokens
    task = asyncio.ensure_future(env.post("/v1/completions", {"prompt": "hi"}).__aenter__())
    req, _ = await asyncio.wait_for(env.backend.requests.get(), 5)
    task.cancel()
    async with asyncio.timeout(5):
        cancel = await env.backend.cancels.get()
    assert cancel.request_id == req.request_id
    await until(lambda: env.gw.router.in_flight == 0)


async def test_no_responders_is_a_fast_503():
    from perigee.natsd import NatsServer

    with NatsServer() as server:  # a private server: nobody subscribes perigee.requests
        nc = await nats.connect(server.url)
        gw = await Gateway(
            GatewayConfig(port=0, sweep_interval_s=0, durable_intake=False), nc, tokenizer=TOK
        ).start()
        try:
            async with aiohttp.ClientSession() as http:
                url = f"http://127.0.0.1:{gw.port}/v1/completions"
                async with http.post(url, json={"prompt": "hi", "stream": True}) as r:
                    assert r.status == 503
                    err = (await r.json())["error"]
            assert "no service is subscribed to perigee.requests" in err["message"]
        finally:
            await gw.close()
            await nc.close()


async def test_shutdown_fails_in_flight_requests(env):
    env.set_behaviour(serve_accept_then_silence)
    task = asyncio.ensure_future(env.post("/v1/completions", {"prompt": "hi"}).__aenter__())
    req, _ = await asyncio.wait_for(env.backend.requests.get(), 5)
    await until(lambda: env.gw.watchdog.stage(req.request_id) == "prefill")
    await env.gw.close(grace_s=0)
    r = await asyncio.wait_for(task, 10)
    assert r.status == 503 and "shutting down" in (await r.json())["error"]["message"]
    r.release()
    async with asyncio.timeout(5):
        assert (await env.backend.cancels.get()).request_id == req.request_id


async def test_long_prompts_tokenize_off_loop(env):
    from services.gateway.protocol import ParsedRequest

    text = "Mooncake disaggregates prefill and decode. " * 200
    p = ParsedRequest(chat=False, model=None, prompt_text=text)
    assert await env.gw._tokenize(p) == TOK.encode(text)
    msgs = [{"role": "user", "content": text}]
    p = ParsedRequest(chat=True, model=None, messages=msgs)
    assert await env.gw._tokenize(p) == TOK.encode_chat(msgs)


def test_cli_args():
    from services.gateway.__main__ import config_from_args, parse_args

    args = parse_args(
        "--nats nats://h:4222 --port 8000 --host 127.0.0.1 --model-dir models/tiny-llama "
        "--served-model-name tiny-llama --block-size 32 --max-prompt-tokens 8192 "
        "--max-tokens-limit 4096 --max-body-bytes 1048576 --request-timeout 120 --dead-after 2.0".split()
    )
    assert args.nats == "nats://h:4222"
    cfg = config_from_args(args)
    assert (cfg.port, cfg.host, cfg.model_dir, cfg.served_model_name, cfg.block_size) == (
        8000,
        "127.0.0.1",
        "models/tiny-llama",
        "tiny-llama",
        32,
    )
    assert (cfg.max_prompt_tokens, cfg.max_tokens_limit, cfg.max_body_bytes) == (
        8192,
        4096,
        1048576,
    )
    assert (cfg.request_timeout_s, cfg.dead_after_s) == (120.0, 2.0)


async def test_ready_only_while_every_part_of_the_path_is_heard(env):
    everything = ["admission", "conductor", "prefill", "decode"]
    async with env.http.get(env.base + "/ready") as r:
        assert r.status == 503 and (await r.json())["missing"] == everything
    await env.backend.load()
    await until(lambda: env.gw.router.live_roles() == {"prefill", "decode"})
    async with env.http.get(env.base + "/ready") as r:  # the workers alone are not enough
        assert r.status == 503 and (await r.json())["missing"] == ["admission", "conductor"]
    await env.backend.present()
    await until(lambda: not env.gw.router.missing())
    async with env.http.get(env.base + "/ready") as r:
        assert r.status == 200 and (await r.json())["missing"] == []
    env.clock.advance(2.5)  # all silent for longer than dead_after_s
    async with env.http.get(env.base + "/ready") as r:
        assert r.status == 503 and (await r.json())["missing"] == everything
    async with env.http.get(env.base + "/health") as r:
        assert r.status == 200  # alive all the same


async def test_models_wait_for_the_stack_once(env):
    """Clients wait for a vLLM server by polling /v1/models: 503 + Retry-After until the
    stack could serve, then the list, even while a part is briefly unheard."""
    async with env.http.get(env.base + "/v1/models") as r:
        body = await r.json()
        assert r.status == 503 and r.headers["Retry-After"] == "1"
    assert "no admission, no conductor, no prefill, no decode" in body["error"]["message"]
    await env.backend.load()
    await until(lambda: env.gw.router.live_roles() == {"prefill", "decode"})
    async with env.http.get(env.base + "/v1/models") as r:
        assert r.status == 503
        assert "no admission, no conductor yet" in (await r.json())["error"]["message"]
    await stack_ready(env)
    async with env.http.get(env.base + "/v1/models") as r:
        assert r.status == 200 and [m["id"] for m in (await r.json())["data"]] == ["tiny-llama"]
    env.clock.advance(2.5)
    async with env.http.get(env.base + "/v1/models") as r:
        assert r.status == 200
