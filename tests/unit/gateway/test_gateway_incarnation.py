"""An instance is its incarnation (services.common.incarnation): the gateway's watchdog
takes a new incarnation under a known name as the death of the old one at once, judges
progress against the request's own prediction, and repeats a cancel until the holders
acknowledge it or their incarnation ends (services.gateway.replies)."""

import asyncio

import msgspec
import nats
import pytest

from bus_schemas import subjects
from bus_schemas.codec import decode, encode
from bus_schemas.load import DecodeLoad
from bus_schemas.requests import Accepted, CancelAck, CancelRequest, ErrorCode, Tokens
from services.common.clock import ManualClock
from services.common.incarnation import RESTARTED, SAME, STALE, judge
from services.gateway.replies import ReplyRouter
from services.gateway.watchdog import Watchdog
from tests.unit.gateway.test_gateway_http import until
from tests.unit.gateway.test_gateway_migration import OUT, env, send  # noqa: F401 - fixture

OLD, NEW = 1_000, 2_000


def make(**kw) -> tuple[Watchdog, ManualClock]:
    clock = ManualClock()
    return Watchdog(clock, 2.0, 120.0, **kw), clock


def test_judge_orders_incarnations():
    assert judge(None, NEW) == SAME  # first heard
    assert judge(OLD, OLD) == SAME
    assert judge(OLD, NEW) == RESTARTED
    assert judge(NEW, OLD) == STALE
    assert judge(OLD, 0) == judge(0, NEW) == SAME  # one side unknown: nothing to say


def test_a_new_incarnation_is_the_old_ones_death_at_once():
    wd, clock = make()
    assert not wd.seen("p0", OLD) and not wd.seen("d0", OLD)
    wd.track("r1")
    wd.accepted("r1", "p0", "d0", OLD, OLD)
    wd.tokens("r1", incarnation=OLD)
    assert wd.sweep() == []
    clock.advance(0.3)  # well within dead_after: heartbeats alone would keep it alive
    assert wd.seen("d0", NEW)
    [v] = wd.sweep()
    assert (v.request_id, v.code, v.dead_role, v.dead_instance) == (
        "r1",
        ErrorCode.UNAVAILABLE,
        "decode",
        "d0",
    )
    assert v.dead_incarnation == OLD and "restarted" in v.message
    assert dict(v.placement) == {"p0": OLD, "d0": OLD}
    assert wd.restarts == 1
    assert not v.wedged  # a death: never placed on again


def test_a_late_report_of_the_dead_incarnation_is_ignored():
    wd, clock = make()
    wd.seen("d0", NEW)
    clock.advance(1.5)
    assert not wd.seen("d0", OLD)  # stale: it does not count as a sign of life
    clock.advance(1.0)
    assert not wd.liveness.alive("d0") and wd.liveness.incarnation("d0") == NEW


def test_an_accepted_naming_a_newer_incarnation_retires_the_old_ones_requests():
    wd, _ = make()
    wd.seen("p0", OLD)
    wd.seen("d0", OLD)
    wd.track("a")
    wd.accepted("a", "p0", "d0", OLD, OLD)
    wd.track("b")
    assert wd.accepted("b", "p0", "d0", NEW, OLD)  # placed on p0's next incarnation
    [v] = wd.sweep()
    assert (v.request_id, v.dead_instance, v.dead_incarnation) == ("a", "p0", OLD)


def test_a_prefill_silent_far_beyond_its_predicted_ttft_is_wedged():
    wd, clock = make(wedge_factor=10.0, wedge_floor_s=5.0)
    wd.track("r1")
    wd.accepted("r1", "p0", "d0", OLD, OLD, est_ttft_s=0.5)  # budget 10 x 0.5 + 5 = 10 s
    for _ in range(9):  # both keep reporting load: alive, but no token comes
        clock.advance(1.0)
        wd.seen("p0", OLD)
        wd.seen("d0", OLD)
        assert wd.sweep() == []
    clock.advance(1.5)
    wd.seen("p0", OLD)
    wd.seen("d0", OLD)
    [v] = wd.sweep()
    assert (v.dead_role, v.dead_instance, v.dead_incarnation) == ("prefill", "p0", OLD)
    assert "no progress" in v.message and wd.wedged == 1
    assert v.wedged  # alive: the conductor may place there again (Migration.wedged)


def test_decode_progress_is_judged_by_its_own_step_time():
    wd, clock = make(wedge_factor=10.0, wedge_floor_s=2.0)
    wd.seen("d0", OLD, step_s=0.1)  # budget 10 x 0.1 + 2 = 3 s between tokens
    wd.seen("p0", OLD)
    wd.track("r1")
    wd.accepted("r1", "p0", "d0", OLD, OLD, est_ttft_s=0.2)
    for i in range(5):  # tokens keep coming every 1.5 s: progressing
        clock.advance(1.5)
        wd.tokens("r1", incarnation=OLD)
        wd.seen("d0", OLD, step_s=0.1)
        assert wd.sweep() == [], i
    for _ in range(3):
        clock.advance(1.1)
        wd.seen("d0", OLD, step_s=0.1)
    [v] = wd.sweep()
    assert (v.dead_role, v.dead_instance) == ("decode", "d0")


def test_silent_instances_are_forgotten():
    wd, clock = make()
    wd.seen("d0", OLD, step_s=0.1)
    clock.advance(100)
    wd.seen("d1", OLD)
    assert wd.forget_silent(60) == 1
    assert not wd.liveness.known("d0") and wd.liveness.known("d1")


# ---------------------------------------------------------------- over a real bus


def decode_load(instance: str, incarnation: int) -> DecodeLoad:
    return DecodeLoad(
        instance=instance,
        node="n0",
        batch_size=1,
        waiting=0,
        max_batch=8,
        kv_tokens=0,
        step_time_s=0.01,
        ts=0.0,
        incarnation=incarnation,
    )


async def test_a_decode_restarted_within_a_second_migrates_its_stream(env):  # noqa: F811
    gw, b, http, _clock = env
    url = f"http://127.0.0.1:{gw.port}/v1/completions"
    body = {"prompt": "hi", "max_tokens": len(OUT), "stream": True, "ignore_eos": True}
    post = asyncio.ensure_future(http.post(url, json=body).__aenter__())
    first, reply = await asyncio.wait_for(b.requests.get(), 5)
    rid = first.request_id
    await b.nc.publish(subjects.load_report("decode", "d0"), encode(decode_load("d0", OLD)))
    await send(
        b,
        reply,
        Accepted(
            request_id=rid,
            prefill_instance="p0",
            decode_instance="d0",
            prefill_incarnation=OLD,
            decode_incarnation=OLD,
        ),
        Tokens(request_id=rid, token_ids=OUT[:1], index=0, from_prefill=True, incarnation=OLD),
        Tokens(request_id=rid, token_ids=OUT[1:3], index=1, incarnation=OLD),
    )
    async with await asyncio.wait_for(post, 5):
        await until(lambda: gw.watchdog.stage(rid) == "decode")
        # The clock never moves: no silence, only the restarted process's first report.
        await b.nc.publish(subjects.load_report("decode", "d0"), encode(decode_load("d0", NEW)))
        again, _ = await asyncio.wait_for(b.requests.get(), 5)
        assert again.request_id == f"{rid}-m1"
        m = again.migration
        assert (m.dead_instance, m.dead_incarnation, m.resumed_tokens) == ("d0", OLD, 3)
        cancel = await asyncio.wait_for(b.cancels.get(), 5)
        assert cancel.request_id == rid and cancel.targets == {"p0": OLD, "d0": OLD}
        assert gw.router.migrations == 1


@pytest.fixture
async def router(nats_url):
    nc = await nats.connect(nats_url)
    wd = Watchdog(ManualClock(), 2.0, 30.0)
    r = ReplyRouter(nc, "gw-cancel", wd)
    await r.start(sweep_interval_s=None)
    yield r, wd
    await r.close()
    await nc.close()


async def holder(nats_url, instance: str, incarnation: int, ack_from: int):
    """A worker that acknowledges the ``ack_from``-th cancel naming it (and counts all)."""
    nc = await nats.connect(nats_url)
    got: list[CancelRequest] = []

    async def on_cancel(msg):
        c = decode(msg.data, CancelRequest)
        got.append(c)
        if instance in c.targets and len(got) >= ack_from and msg.reply:
            ack = CancelAck(request_id=c.request_id, instance=instance, incarnation=incarnation)
            await nc.publish(msg.reply, encode(ack))

    await nc.subscribe(subjects.CANCEL, cb=on_cancel)
    await nc.flush()
    await nc.flush()
    return nc, got


async def test_a_cancel_is_repeated_until_the_holder_acknowledges_it(router, nats_url):
    r, wd = router
    wd.seen("d0", OLD)
    nc, got = await holder(nats_url, "d0", OLD, ack_from=3)  # the first two are "lost"
    await asyncio.wait_for(r.cancel("r1", "client disconnected", [("d0", OLD)]), 10)
    assert len(got) == 3 and all(c.targets == {"d0": OLD} for c in got)
    assert r.cancels_acked == 1
    await nc.close()


async def test_a_cancel_stops_repeating_when_its_incarnation_ends(router, nats_url):
    r, wd = router
    wd.seen("d0", OLD)
    nc, got = await holder(nats_url, "d0", OLD, ack_from=10**9)  # never acknowledges
    task = asyncio.ensure_future(r.cancel("r1", "client disconnected", [("d0", OLD)]))
    await until(lambda: len(got) >= 2)
    assert not task.done()
    wd.seen("d0", NEW)  # restarted: the old process held the request and is gone
    await asyncio.wait_for(task, 10)
    assert r.cancels_acked == 0
    await nc.close()


async def test_a_cancel_before_placement_goes_to_the_instances_of_the_late_accepted(
    router, nats_url
):
    r, wd = router
    wd.seen("p0", OLD)
    wd.seen("d0", OLD)
    nc, got = await holder(nats_url, "d0", OLD, ack_from=1)
    await r.cancel("r9", "client disconnected")  # not placed: no holder known
    await until(lambda: len(got) == 1)
    assert got[0].targets == {}
    acc = Accepted(
        request_id="r9",
        prefill_instance="p0",
        decode_instance="d0",
        prefill_incarnation=OLD,
        decode_incarnation=OLD,
    )
    await nc.publish(r.reply_subject("r9"), encode(acc))
    await until(lambda: len(got) >= 2)
    assert got[1].targets == {"p0": OLD, "d0": OLD}
    await nc.close()


def test_heartbeat_reads_only_what_it_needs():
    from services.gateway.replies import _heartbeat

    hb = _heartbeat.decode(msgspec.json.encode(decode_load("d0", NEW)))
    assert (hb.incarnation, hb.step_time_s) == (NEW, 0.01)


# ------------------------------------------- the intake stalls (a JetStream election)


@pytest.fixture
async def stalled_intake(nats_url, monkeypatch):
    """A gateway on the durable intake whose stream never stores (every publish times
    out, as while the stream has no leader)."""
    from services.common import bus
    from services.gateway.server import Gateway, GatewayConfig
    from tests.unit.gateway.test_gateway_http import TOK, FakeBackend, serve_nothing

    async def leaderless(js, subject, *a, **kw):
        raise TimeoutError(f"no leader for {subject}")

    monkeypatch.setattr(bus, "js_publish", leaderless)

    cfg = GatewayConfig(
        port=0,
        durable_intake=True,
        intake_patience_s=0.3,
        max_prompt_tokens=64,
        max_tokens_limit=100,
        max_model_len=128,
        sweep_interval_s=0,
    )
    nc_gw, nc_be = await nats.connect(nats_url), await nats.connect(nats_url)
    gw = await Gateway(cfg, nc_gw, tokenizer=TOK, clock=ManualClock()).start()
    backend = await FakeBackend(nc_be, serve_nothing).start()
    yield gw, backend
    await gw.close()
    await nc_gw.close()
    await nc_be.close()


async def test_a_request_the_intake_does_not_store_in_time_goes_on_the_core_path(
    stalled_intake, nats_url
):
    import aiohttp

    from bus_schemas.requests import Finished

    gw, b = stalled_intake
    url = f"http://127.0.0.1:{gw.port}/v1/completions"
    body = {"prompt": "hi", "max_tokens": 3, "ignore_eos": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
        post = asyncio.ensure_future(http.post(url, json=body))
        req, reply = await asyncio.wait_for(b.requests.get(), 10)
        assert req.core_path and req.request_id.endswith("-b1")
        assert reply == req.reply_subject == gw.router.reply_subject(req.request_id)
        rid = req.request_id.removesuffix("-b1")
        await send(
            b,
            reply,
            Accepted(request_id=req.request_id, prefill_instance="p0", decode_instance="d0"),
            Tokens(request_id=req.request_id, token_ids=OUT[:3], index=0),
            Finished(
                request_id=req.request_id,
                finish_reason="length",
                prompt_tokens=len(req.prompt_token_ids),
                completion_tokens=3,
                cached_tokens=0,
            ),
        )
        async with await post as r:
            assert r.status == 200
            out = await r.json()
    assert out["usage"]["completion_tokens"] == 3
    assert gw.router.bypasses == 1
    # Should the intake store the first copy after all, its placement is cancelled when
    # its Accepted comes: the holders it names are told, by name and incarnation.
    gw.watchdog.seen("p1", OLD)
    gw.watchdog.seen("d1", OLD)
    late = Accepted(
        request_id=rid,
        prefill_instance="p1",
        decode_instance="d1",
        prefill_incarnation=OLD,
        decode_incarnation=OLD,
    )
    await send(b, gw.router.reply_subject(rid), late)
    while True:
        c = await asyncio.wait_for(b.cancels.get(), 5)
        if c.request_id == rid and c.targets:
            break
    assert c.targets == {"p1": OLD, "d1": OLD}


async def test_the_router_forgets_instances_silent_for_long(router):
    from services.gateway import replies

    r, wd = router
    wd.seen("d-gone", OLD)
    r.roles["d-gone"] = "decode"
    wd.clock.advance(replies.FORGET_INSTANCE_S + 1)
    wd.seen("d-live", OLD)
    r.roles["d-live"] = "decode"
    r.prune()
    assert set(r.roles) == {"d-live"} and not wd.liveness.known("d-gone")


def test_the_work_queues_are_bounded_and_refuse_new_when_full():
    from nats.js import api

    from services.common import intake_queue as iq

    for name in (iq.INTAKE_STREAM, iq.SCHEDULE_STREAM):
        cfg = iq.stream_configs(1)[name]
        assert cfg.max_msgs == iq.MAX_QUEUED and cfg.max_bytes == iq.MAX_QUEUED_BYTES
        assert cfg.discard == api.DiscardPolicy.NEW
    # A full queue's refusal is an overload, not a stall: no core-path bypass for it.
    import nats.js.errors

    assert not issubclass(nats.js.errors.APIError, iq.STALLED)


async def test_an_event_on_a_guessed_reply_subject_never_reaches_the_stream(env):  # noqa: F811
    """Any worker may publish on reply subjects; only the instances a request was placed
    on are told its subject's nonce. A guess (the attempt id with a wrong or no nonce)
    is dropped and counted; the stream goes on with the genuine events only."""
    from bus_schemas.requests import Finished

    gw, b, http, _clock = env
    url = f"http://127.0.0.1:{gw.port}/v1/completions"
    body = {"prompt": "hi", "max_tokens": 3, "ignore_eos": True}
    post = asyncio.ensure_future(http.post(url, json=body))
    req, reply = await asyncio.wait_for(b.requests.get(), 5)
    rid = req.request_id
    prefix = f"perigee.gw.{gw.gateway_id}.{rid}"
    forged = Tokens(request_id=rid, token_ids=OUT[3:6], index=0)
    for subject in (f"{prefix}.guess", prefix):
        await b.nc.publish(subject, encode(forged))
    await send(
        b,
        reply,
        Accepted(request_id=rid, prefill_instance="p0", decode_instance="d0"),
        Tokens(request_id=rid, token_ids=OUT[:3], index=0),
        Finished(
            request_id=rid,
            finish_reason="length",
            prompt_tokens=len(req.prompt_token_ids),
            completion_tokens=3,
            cached_tokens=0,
        ),
    )
    async with await post as r:
        out = await r.json()
    from tests.unit.gateway.test_gateway_http import TOK

    assert out["choices"][0]["text"] == TOK.decode(OUT[:3])
    assert gw.router.forged_events == 2  # the wrong nonce and the missing one
