"""Migration of a request whose worker died: the pure plan (services.gateway.resend),
the conductor's placement of a migrated request (services.conductor.migrated_placement), and
the gateway in-process over a real nats-server with a fake backend that plays the
dead and the new instance (services.gateway.replies)."""

import asyncio
import math

import aiohttp
import nats
import nats.errors
import pytest

from bus_schemas import subjects
from bus_schemas.codec import encode
from bus_schemas.requests import (
    Accepted,
    Error,
    ErrorCode,
    Finished,
    GenerateRequest,
    Migration,
    SamplingParams,
    Tokens,
)
from services.common.clock import ManualClock
from services.common.hashing import block_hashes
from services.conductor.migrated_placement import placement_for
from services.conductor.placement_policy import Placement, Rejection
from services.gateway import resend
from services.gateway.server import Gateway, GatewayConfig
from tests.unit.conductor.test_conductor_policy import make_policy, req
from tests.unit.gateway.test_gateway_http import (
    TOK,
    FakeBackend,
    quiet_backend_gateway,
    read_sse,
    serve_nothing,
    until,
)
from tracing import setup_tracing

BS = 4
PROMPT = list(range(10, 20))  # two full blocks of 4 and a tail of 2
ORIGINAL = GenerateRequest(
    request_id="cmpl-1",
    prompt_token_ids=PROMPT,
    block_size=BS,
    block_hashes=block_hashes(PROMPT, BS),
    sampling=SamplingParams(max_tokens=8),
    reply_subject="perigee.gw.g.cmpl-1",
    arrival_ts=5.0,
)


def plan(generated, attempts=0, limit=3, role="decode", **kw):
    return resend.plan(
        ORIGINAL,
        generated,
        attempts=attempts,
        limit=limit,
        dead_role=role,
        dead_instance=f"{role}-0",
        reply_subject="perigee.gw.g.cmpl-1-m1",
        **kw,
    )


# ---------------------------------------------------------------- the pure plan


def test_resume_appends_the_generated_tokens_and_asks_for_the_rest():
    d = plan([7, 8, 9])
    assert isinstance(d, resend.Resume) and d.offset == 3
    r = d.request
    assert r.request_id == "cmpl-1-m1" and r.reply_subject == "perigee.gw.g.cmpl-1-m1"
    assert r.prompt_token_ids == [*PROMPT, 7, 8, 9]
    assert r.sampling.max_tokens == 5
    # The prompt's block hashes are a prefix of the new ones: placement finds its KV.
    assert r.block_hashes == block_hashes([*PROMPT, 7, 8, 9], BS)
    assert r.block_hashes[:2] == ORIGINAL.block_hashes
    assert r.migration == Migration(
        of_request_id="cmpl-1",
        attempt=1,
        reason="decode_died",
        dead_instance="decode-0",
        resumed_tokens=3,
        prompt_tokens=10,
        dead_request_id="cmpl-1",
    )


def test_prefill_death_before_the_first_token_resends_the_prompt_as_it_was():
    d = plan([], role="prefill")
    assert isinstance(d, resend.Resume) and d.offset == 0
    assert d.request.prompt_token_ids == PROMPT and d.request.sampling.max_tokens == 8
    assert d.request.migration.reason == "prefill_died"


def test_second_migration_counts_attempts():
    d = plan([7], attempts=1)
    assert d.request.request_id == "cmpl-1-m2" and d.request.migration.attempt == 2
    assert d.request.migration.dead_request_id == "cmpl-1-m1"


def test_nothing_is_resent_when_the_client_has_every_token():
    assert plan(list(range(8))) == resend.Finish("length")
    assert plan([7, 2], eos_token_ids=(2,)) == resend.Finish("stop")
    s = SamplingParams(max_tokens=8, ignore_eos=True)
    d = resend.plan(
        GenerateRequest(request_id="r", prompt_token_ids=PROMPT, sampling=s),
        [7, 2],
        attempts=0,
        limit=3,
        dead_role="decode",
        dead_instance="d",
        reply_subject="x",
        eos_token_ids=(2,),
    )
    assert isinstance(d, resend.Resume)  # EOS does not end an ignore_eos request
    s = SamplingParams(max_tokens=8, stop_token_ids=[9])
    d = resend.plan(
        GenerateRequest(request_id="r", prompt_token_ids=PROMPT, sampling=s),
        [7, 9],
        attempts=0,
        limit=3,
        dead_role="decode",
        dead_instance="d",
        reply_subject="x",
    )
    assert d == resend.Finish("stop")


def test_a_wedge_verdict_rides_on_the_migration():
    assert plan([1, 2], wedged=True).request.migration.wedged
    assert not plan([1, 2]).request.migration.wedged


def test_past_the_limit_is_a_clear_error():
    d = plan([7], attempts=2, limit=2)
    assert isinstance(d, resend.GiveUp)
    assert "decode instance decode-0 stopped responding" in d.message
    assert "migrated 2 time(s) already (--migration-limit 2)" in d.message
    off = plan([7], limit=0)
    assert (
        isinstance(off, resend.GiveUp) and "migration is off (--migration-limit 0)" in off.message
    )


def test_a_death_verdict_names_the_role_and_instance_a_timeout_does_not():
    from services.gateway.watchdog import Watchdog

    clock = ManualClock()
    wd = Watchdog(clock, dead_after_s=2.0, request_timeout_s=10.0)
    for rid in ("a", "b"):
        wd.track(rid)
    wd.accepted("a", "p0", "d0")
    wd.tokens("a")
    clock.advance(2.5)
    [v] = wd.sweep()
    assert (v.request_id, v.dead_role, v.dead_instance) == ("a", "decode", "d0")
    clock.advance(10)
    [t] = wd.sweep()
    assert (t.request_id, t.dead_role, t.dead_instance) == ("b", "", "")


# ---------------------------------------------------------------- conductor placement


def mig(reason="decode_died", dead="d0") -> Migration:
    return Migration(
        of_request_id="r",
        attempt=1,
        reason=reason,
        dead_instance=dead,
        resumed_tokens=3,
        prompt_tokens=100,
    )


def test_a_migration_is_placed_where_an_slo_would_reject_a_new_request():
    clock = ManualClock(100.0)
    pol = make_policy(clock, decodes=(("d0", "m0"), ("d1", "m1")), ttft_slo_s=1e-6)
    assert isinstance(pol.place(req("new"), {"n1": 3}), Rejection)
    preq, exclude = placement_for(req("r-m1", arrival_ts=1.0), mig())
    assert preq.ttft_slo_s == math.inf and preq.tbt_slo_s == math.inf and preq.arrival_ts == 0
    assert exclude == {"exclude_decode": ("d0",)}
    d = pol.place(preq, {"n1": 3}, **exclude)
    assert isinstance(d, Placement)
    assert d.decode_instance == "d1"  # d0 reported just now, yet it is the dead one
    assert d.prefill_node == "n1" and d.prefix_blocks == 3  # the prompt's KV from the store


def test_a_migration_never_goes_back_to_its_dead_instance():
    pol = make_policy(decodes=(("d0", "m0"),))
    preq, exclude = placement_for(req("r-m1"), mig())
    d = pol.place(preq, {}, **exclude)
    assert isinstance(d, Rejection) and "no live decode instance" in d.reason
    preq, exclude = placement_for(req("r-m1"), mig("prefill_died", "p1"))
    assert exclude == {"exclude_prefill": ("p1",)}
    assert pol.place(preq, {"n1": 3}, **exclude).prefill_instance == "p0"


# ---------------------------------------------------------------- the gateway

OUT = TOK.encode("one two three four five six", add_bos=False)


@pytest.fixture
async def env(nats_url):
    clock = ManualClock()
    cfg = GatewayConfig(
        port=0,
        durable_intake=False,  # the fake admission is on core NATS
        max_prompt_tokens=64,
        max_tokens_limit=100,
        max_model_len=128,
        dead_after_s=2.0,
        request_timeout_s=10.0,
        sweep_interval_s=0,
        migration_limit=1,
    )
    async with quiet_backend_gateway(nats_url, cfg, clock) as (gw, backend, http):
        yield gw, backend, http, clock


async def send(b: FakeBackend, reply: str, *events) -> None:
    for ev in events:
        await b.nc.publish(reply, encode(ev))
    await b.nc.flush()


def trace_id(headers: dict) -> str:
    return headers["traceparent"].split("-")[1]


async def test_decode_death_mid_stream_migrates_and_the_stream_goes_on(env, monkeypatch):
    gw, b, http, clock = env
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    setup_tracing("test")  # (once per process: whichever test comes first)
    url = f"http://127.0.0.1:{gw.port}/v1/completions"
    body = {
        "prompt": "hi",
        "max_tokens": len(OUT),
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    # The response starts with the first token: post in a task, play the backend here.
    post = asyncio.ensure_future(http.post(url, json=body).__aenter__())
    first, reply = await asyncio.wait_for(b.requests.get(), 5)
    rid = first.request_id
    await send(
        b,
        reply,
        Accepted(request_id=rid, prefill_instance="p0", decode_instance="d0"),
        Tokens(request_id=rid, token_ids=OUT[:1], index=0, from_prefill=True),
        Tokens(request_id=rid, token_ids=OUT[1:3], index=1),
    )
    async with await asyncio.wait_for(post, 5) as r:
        await until(lambda: gw.watchdog.stage(rid) == "decode")
        # p0 and a new d1 keep reporting; d0 went silent.
        clock.advance(2.5)
        gw.watchdog.seen("p0")
        gw.watchdog.seen("d1")
        assert gw.router.sweep() == 1
        again, reply2 = await asyncio.wait_for(b.requests.get(), 5)
        cancel = await asyncio.wait_for(b.cancels.get(), 5)
        assert cancel.request_id == rid  # the dead attempt is told to stop
        assert again.request_id == f"{rid}-m1" and reply2 == again.reply_subject != reply
        assert again.prompt_token_ids == [*first.prompt_token_ids, *OUT[:3]]
        assert again.sampling.max_tokens == len(OUT) - 3
        assert again.migration.resumed_tokens == 3 and again.migration.dead_instance == "d0"
        # Sent from the watchdog's sweep, the attempt and the dead attempt's cancel are
        # still in the request's trace.
        assert trace_id(b.headers[1]) == trace_id(b.headers[0])
        assert trace_id(b.cancel_headers[0]) == trace_id(b.headers[0])
        # A late event of the dead attempt is dropped; the new attempt's index 0 is the
        # client's token 3, and a repeat of it (index 0 again) is not shown twice.
        aid = again.request_id
        await send(b, reply, Tokens(request_id=rid, token_ids=[OUT[0]], index=3))
        await send(
            b,
            reply2,
            Accepted(request_id=aid, prefill_instance="p0", decode_instance="d1"),
            Tokens(request_id=aid, token_ids=OUT[3:4], index=0, from_prefill=True),
            Tokens(request_id=aid, token_ids=OUT[3:], index=0),
            Finished(
                request_id=aid,
                finish_reason="length",
                prompt_tokens=len(again.prompt_token_ids),
                completion_tokens=len(OUT) - 3,
                cached_tokens=0,
            ),
        )
        chunks, done = await read_sse(r)
    assert done
    text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    assert text == TOK.decode(OUT)  # every token once, in order
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == len(OUT)
    assert usage["prompt_tokens"] == len(first.prompt_token_ids)
    assert gw.router.migrations == 1


async def test_a_second_death_past_the_limit_is_a_clear_error(env):
    gw, b, http, clock = env
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
        Tokens(request_id=rid, token_ids=OUT[:2], index=0),
    )
    async with await asyncio.wait_for(post, 5) as r:
        await until(lambda: gw.watchdog.stage(rid) == "decode")
        clock.advance(2.5)
        gw.watchdog.seen("p0")
        assert gw.router.sweep() == 1
        again, reply2 = await asyncio.wait_for(b.requests.get(), 5)
        await send(
            b,
            reply2,
            Accepted(request_id=again.request_id, prefill_instance="p0", decode_instance="d1"),
        )
        await until(lambda: gw.watchdog.stage(rid) == "prefill")
        clock.advance(2.5)  # d1 dies too, before its first token
        gw.watchdog.seen("p0")
        assert gw.router.sweep() == 1
        chunks, done = await read_sse(r)
    assert not done
    err = chunks[-1]["error"]
    assert err["code"] == "service_unavailable"
    assert "decode instance d1 stopped responding" in err["message"]
    assert "(--migration-limit 1)" in err["message"]
    assert b.requests.empty()  # no third attempt
    await until(lambda: gw.router.in_flight == 0)


async def serve_the_rest(b: FakeBackend, reply: str, again, resumed: int) -> None:
    """A migrated attempt placed, streaming OUT past the ``resumed`` tokens, finished."""
    aid = again.request_id
    await send(
        b,
        reply,
        Accepted(request_id=aid, prefill_instance="p0", decode_instance="d1"),
        Tokens(request_id=aid, token_ids=OUT[resumed:], index=0),
        Finished(
            request_id=aid,
            finish_reason="length",
            prompt_tokens=len(again.prompt_token_ids),
            completion_tokens=len(OUT) - resumed,
            cached_tokens=0,
        ),
    )


STORE_DOWN = "kv transfer failed: closed: channel tcp://p1 closed"


async def _store_fails_under(gw, b, http, failures: int):
    """A stream whose first attempt gets 2 tokens, then a store failure; each resend
    fails on the store again ``failures - 1`` times; whatever is sent after that is
    served. Returns (the SSE chunks, whether [DONE] came, the attempts sent)."""
    url = f"http://127.0.0.1:{gw.port}/v1/completions"
    body = {"prompt": "hi", "max_tokens": len(OUT), "stream": True, "ignore_eos": True}
    post = asyncio.ensure_future(http.post(url, json=body).__aenter__())
    first, reply = await asyncio.wait_for(b.requests.get(), 5)
    rid = first.request_id
    await send(
        b,
        reply,
        Accepted(request_id=rid, prefill_instance="p0", decode_instance="d0"),
        Tokens(request_id=rid, token_ids=OUT[:2], index=0),
    )
    sent = [first]
    async with await asyncio.wait_for(post, 5) as r:
        await send(b, reply, Error(request_id=rid, code=ErrorCode.UNAVAILABLE, message=STORE_DOWN))
        for k in range(1, failures + 1):
            try:
                again, reply_k = await asyncio.wait_for(b.requests.get(), 10)
            except TimeoutError:
                break  # not sent again: the stream ended
            sent.append(again)
            aid = again.request_id
            assert aid == f"{rid}-m{k}" and again.migration.resumed_tokens == 2
            if k < failures:
                await send(
                    b,
                    reply_k,
                    Error(request_id=aid, code=ErrorCode.UNAVAILABLE, message=STORE_DOWN),
                )
                continue
            await serve_the_rest(b, reply_k, again, resumed=2)
        chunks, done = await read_sse(r)
    return chunks, done, sent


async def test_a_store_restarting_under_a_request_is_waited_out_not_counted(env):
    """Store p1 was SIGKILLed: each placement on it fails at once until its supervisor
    brings it back. Three failures in a row under --migration-limit 1 still end in a
    whole stream: within --migration-wait, a store failure is sent again after a pause
    and not counted as a migration."""
    gw, b, http, clock = env
    chunks, done, sent = await _store_fails_under(gw, b, http, failures=3)
    assert done
    assert "".join(c["choices"][0]["text"] for c in chunks if c.get("choices")) == (TOK.decode(OUT))
    assert len(sent) == 4 and gw.router.migrations == 3


async def test_a_store_failure_past_the_wait_counts_as_a_migration(env):
    gw, b, http, clock = env
    gw.router.migration_wait_s = 0.0  # no wait: each store failure is a migration
    chunks, done, sent = await _store_fails_under(gw, b, http, failures=3)
    assert not done
    assert len(sent) == 2  # the first attempt and one migration (--migration-limit 1)
    err = chunks[-1]["error"]
    assert err["code"] == "service_unavailable"
    assert STORE_DOWN in err["message"] and "(--migration-limit 1)" in err["message"]


async def nobody_subscribes(nc, subject: str) -> None:
    """Until the server answers "no responders" on ``subject`` (a closed client's
    subscriptions outlive its close() until the server has read it)."""
    async with asyncio.timeout(10):
        while True:
            try:
                await nc.request(subject, b"", timeout=0.5)
            except nats.errors.NoRespondersError:
                return
            except nats.errors.TimeoutError:
                continue  # delivered to the closed client's stale subscription


async def test_a_migration_nobody_takes_yet_is_sent_again_until_admission_is_back(nats_url):
    """A NATS server died: the resend of an accepted request can find admission still
    reconnecting (no responders on perigee.requests). It is sent again, not failed."""
    clock = ManualClock()
    cfg = GatewayConfig(
        port=0,
        durable_intake=False,  # the fake admission is on core NATS
        max_prompt_tokens=64,
        max_tokens_limit=100,
        max_model_len=128,
        dead_after_s=2.0,
        request_timeout_s=30.0,
        sweep_interval_s=0,
        migration_limit=1,
    )
    nc_gw, nc_b1, nc_b2 = [await nats.connect(nats_url) for _ in range(3)]
    gw = await Gateway(cfg, nc_gw, tokenizer=TOK, clock=clock).start()
    b1 = await FakeBackend(nc_b1, serve_nothing).start()
    body = {"prompt": "hi", "max_tokens": len(OUT), "stream": True, "ignore_eos": True}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            url = f"http://127.0.0.1:{gw.port}/v1/completions"
            post = asyncio.ensure_future(http.post(url, json=body).__aenter__())
            first, reply = await asyncio.wait_for(b1.requests.get(), 5)
            rid = first.request_id
            await send(
                b1,
                reply,
                Accepted(request_id=rid, prefill_instance="p0", decode_instance="d0"),
                Tokens(request_id=rid, token_ids=OUT[:2], index=0),
            )
            async with await asyncio.wait_for(post, 5) as r:
                await until(lambda: gw.watchdog.stage(rid) == "decode")
                await nc_b1.close()  # admission is gone from the bus for now
                # The server drops b1's subscription when it reads the close, which can
                # come after the gateway's resend on a loaded box: wait until it has.
                await nobody_subscribes(nc_b2, subjects.REQUESTS)
                clock.advance(2.5)
                gw.watchdog.seen("p0")
                assert gw.router.sweep() == 1
                await until(lambda: gw.router.resends_unanswered >= 1)
                b2 = await FakeBackend(nc_b2, serve_nothing).start()  # admission is back
                again, reply2 = await asyncio.wait_for(b2.requests.get(), 10)
                assert again.request_id == f"{rid}-m1" and again.migration.resumed_tokens == 2
                await serve_the_rest(b2, reply2, again, resumed=2)
                chunks, done = await read_sse(r)
        assert done  # the stream was not cut with "no service is subscribed"
        assert "".join(c["choices"][0]["text"] for c in chunks if c.get("choices")) == (
            TOK.decode(OUT)
        )
    finally:
        await gw.close()
        for nc in (nc_gw, nc_b1, nc_b2):
            await nc.close()


# ---------------------------------------------------------------- the conductor service


async def test_conductor_places_a_migration_on_another_decode_and_drops_the_dead_attempt(nats_url):
    from bus_schemas import subjects
    from services.common import metrics
    from tests.unit.conductor.test_conductor_service import HASHES, PROMPT, FakeStore, Harness

    h = Harness(nats_url)
    try:
        await h.start(
            [FakeStore(None, "np0", held=HASHES), FakeStore(None, "nd0"), FakeStore(None, "nd1")],
            prefills=[("prefill-0", "np0", 0.0)],
            decodes=[("decode-0", "nd0"), ("decode-1", "nd1")],
        )
        await h.schedule("r1")
        dead = (await h.task()).decode_instance
        assert set(h.svc.pending) == {"r1"}
        before = metrics.sample(metrics.MIGRATIONS, reason="decode_died")
        m = Migration(
            of_request_id="r1",
            attempt=1,
            reason="decode_died",
            dead_instance=dead,
            resumed_tokens=5,
            prompt_tokens=len(PROMPT),
            dead_request_id="r1",
        )
        again = GenerateRequest(
            request_id="r1-m1",
            prompt_token_ids=[*PROMPT, 1, 2, 3, 4, 5],
            reply_subject=h.inbox,
            migration=m,
        )
        await h.nc.publish(subjects.SCHEDULE, encode(again))
        task = await h.task()
        assert task.request.request_id == "r1-m1"
        assert task.decode_instance != dead  # its last report is still fresh here
        assert task.expected_hit_blocks == len(HASHES)  # the prompt's blocks on np0
        assert set(h.svc.pending) == {"r1-m1"}  # the dead attempt's books are gone
        assert metrics.sample(metrics.MIGRATIONS, reason="decode_died") == before + 1
    finally:
        await h.close()


async def test_a_death_after_the_last_token_ends_the_stream_without_a_resend(env):
    gw, b, http, clock = env
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
    # Every token arrived; the Finished died with the decode instance.
    await send(
        b,
        reply,
        Accepted(request_id=rid, prefill_instance="p0", decode_instance="d0"),
        Tokens(request_id=rid, token_ids=OUT, index=0),
    )
    async with await asyncio.wait_for(post, 5) as r:
        await until(lambda: gw.watchdog.stage(rid) == "decode")
        clock.advance(2.5)
        gw.watchdog.seen("p0")
        assert gw.router.sweep() == 1
        chunks, done = await read_sse(r)
    assert done
    assert "".join(c["choices"][0]["text"] for c in chunks if c.get("choices")) == TOK.decode(OUT)
    assert chunks[-1]["usage"]["completion_tokens"] == len(OUT)
    assert [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")][-1] == "length"
    assert b.requests.empty() and gw.router.migrations == 0


def test_a_store_that_failed_under_a_request_is_a_reason_to_migrate_it():
    from services.common.kv_errors import store_failure

    assert store_failure(503, "kv transfer failed: closed: channel tcp://p1 closed")
    assert store_failure(503, "kv transfer failed: timeout: no reply in 10.0s (peer down?)")
    assert store_failure(503, "kv reservation failed: store unavailable (prefill: p1 ...)")
    # Not a store failure: no room after the wait, a bad task, a dead engine, a 429.
    assert not store_failure(503, "kv reservation failed: no room on p1 after 60 s")
    assert not store_failure(500, "bad prefill task: wrong node")
    assert not store_failure(503, "prefill engine is down")
    assert not store_failure(429, "kv transfer failed: closed")
