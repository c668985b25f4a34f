"""The stack behind its own promises (services.gateway.lateness): a new request gets
429 + Retry-After while a request's first token is overdue by more than
--max-lateness-ms (not placed: since it was sent; placed: since the conductor's TTFT
estimate), or while as many requests wait for their first token as late first tokens
capped; its first token, end or failure ends what it owes. That gate is off by default;
--max-overhead-ms (on by default, 20 ms) judges only what no engine's pace moves: a request
unplaced for longer, and first tokens whose wait less the engine's part
(Tokens.engine_s) is longer.

On a real nats-server with a fake admission that answers only when the test says;
time is the gateway's injected clock, moved by hand."""

import asyncio

import aiohttp
import nats
import pytest

from bus_schemas.requests import Accepted, Tokens
from services.common import metrics
from services.common.clock import ManualClock
from services.gateway.lateness import BACKLOG, CAP_MAX, CAP_MIN, Lateness
from services.gateway.server import Gateway, GatewayConfig
from tests.unit.gateway.test_gateway_http import TOK, FakeBackend, until

HI = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_the_most_overdue_request_sets_the_lateness():
    late = Lateness(limit_s=0.05)
    assert late.overdue(5.0) == 0.0
    late.sent("a", 1.0)
    late.sent("b", 2.0)
    late.sent("a", 3.0)  # a resend keeps what it owed
    assert late.overdue(4.0) == 3.0 and len(late) == 2
    late.placed("a", 4.0, est_ttft_s=2.0)  # due at 6
    assert late.overdue(4.5) == 2.5  # b, unplaced since 2
    late.done("b")
    assert late.overdue(4.5) == 0.0  # a is not due yet
    assert late.overdue(7.0) == 1.0
    late.placed("gone", 7.0, 1.0)  # never sent (or already done): nothing owed
    late.done("a")
    late.done("never-sent")
    assert late.overdue(100.0) == 0.0 and len(late) == 0


def test_stale_heap_entries_stay_bounded():
    late = Lateness(limit_s=0.05)
    for i in range(10_000):
        late.sent("r", float(i))
        late.placed("r", float(i), 0.5)
        late.done("r")
        late.sent(f"k{i % 3}", float(i))
    assert len(late) == 3
    assert len(late._heap) <= 4 * len(late) + 64 + 1
    assert late.overdue(10_000.0) == 10_000.0  # k0, k1, k2 were first sent at 0, 1, 2


def test_late_first_tokens_cap_how_many_may_wait_and_on_time_ones_raise_it():
    late = Lateness(limit_s=0.02)
    assert late.cap == CAP_MAX and not late.full(0.0)
    for i in range(50):
        late.sent(f"r{i}", 0.0)  # unplaced: due at once
    late.first_token("r0", 0.01)  # 10 ms after due: on time, the cap is at its top
    assert late.cap == CAP_MAX
    late.first_token("r1", 0.03)  # 30 ms late: 48 still wait -> 0.9 x 49
    assert late.cap == pytest.approx(44.1) and late.full(0.03)  # 48 wait, the cap lets 44
    late.first_token("r2", 0.04)  # the same backlog (within 20 ms of the cut): no second cut
    assert late.cap == pytest.approx(44.1)
    late.first_token("r3", 0.05)  # 20 ms on: a backlog still late cuts again, from 46 waiting
    assert late.cap == pytest.approx(0.9 * 44.1)
    for i in range(4, 10):
        late.first_token(f"r{i}", 0.05)
    assert len(late) == 40 and late.full(0.05)  # int(39.69) = 39 <= 40
    late.sent("x", 1.0)
    late.placed("x", 1.0, est_ttft_s=0.5)
    late.first_token("x", 1.51)  # on time (10 ms past an estimate): up by 1/cap
    raised = 0.9 * 44.1 + 1 / (0.9 * 44.1)
    assert late.cap == pytest.approx(raised)
    late.first_token("x", 9.0)  # not waiting any more: nothing owed, nothing moves
    late.first_token("never-sent", 9.0)
    assert late.cap == pytest.approx(raised)
    for i in range(10, 50):
        late.first_token(f"r{i}", 100.0)  # all very late, at once: one cut, from 39 waiting
    assert late.cap == pytest.approx(0.9 * raised) and len(late) == 0  # raised < 39 + 1
    for i in range(200):  # a cap's worth of first tokens on time raise it by about one
        late.sent(f"t{i}", 150.0)
        late.first_token(f"t{i}", 150.0)
    assert 0.9 * raised + 5 < late.cap < 0.9 * raised + 6
    late.sent("a", 200.0)
    late.first_token("a", 201.0)  # late with nobody else waiting: down to the floor
    assert late.cap == CAP_MIN and not late.full(201.0)
    for i in range(CAP_MIN):
        late.sent(f"n{i}", 201.5)
    assert late.full(201.5)  # the floor: four may always wait
    late.done("n0")  # a failure is no first token: the cap stays
    assert late.cap == CAP_MIN and not late.full(201.5)
    late.sent("n0", 202.0)
    assert late.full(202.0)
    # No late first token for a second: the backlog the cut answered is gone.
    assert not late.full(202.01) and late.cap == CAP_MAX


def test_only_the_overhead_net_of_the_engine_moves_the_cap():
    late = Lateness(overhead_s=0.02)
    late.cap = 10.0
    for i in range(6):
        late.sent(f"r{i}", 0.0)
    # Nothing placed at all: a dead admission (or one starting), not a backlog.
    assert late.overdue(0.5) == 0.0
    late.placed("r0", 0.49, est_ttft_s=0.1)
    assert late.overdue(0.5) == 0.5  # r1..r5 are still unplaced, while r0 was placed
    assert late.overdue(0.52) == 0.0  # and no placement since, for longer than 20 ms
    for i in range(1, 6):
        late.placed(f"r{i}", 0.5, est_ttft_s=0.1)
    # Placed, each is the engine's now: ten seconds past any estimate is no overdue.
    assert late.overdue(10.0) == 0.0
    late.first_token("r0", 10.0, engine_s=9.99)  # 10 ms of it the control plane's
    assert late.cap == pytest.approx(10.1)
    late.first_token("r1", 10.0, engine_s=None)  # says nothing of the engine: no move
    assert late.cap == pytest.approx(10.1)
    late.first_token("r2", 10.0, engine_s=9.9)  # 100 ms of overhead: cut, from 3 waiting
    assert late.cap == CAP_MIN
    late.cap = 10.0
    late.disturbed(10.5)  # a service died: r3..r5 wait for its restart
    late.first_token("r3", 11.0, engine_s=0.0)
    assert late.cap == 10.0
    late.sent("r4", 11.0)  # resent: its overhead counts from now
    late.first_token("r4", 11.01, engine_s=0.0)
    assert late.cap == pytest.approx(10.1)
    assert len(late) == 1 and not late.full(11.01)


def test_one_request_late_among_others_placed_is_no_backlog():
    late = Lateness(overhead_s=0.02)
    for i in range(6):  # a burst of six long prompts
        late.sent(f"b{i}", 0.0)
    for i in range(1, 6):
        late.placed(f"b{i}", 0.02, est_ttft_s=0.5)
    assert late.overdue(0.023) == 0.0  # b0 unplaced for 23 ms: a hiccup
    for i in range(BACKLOG - 1):
        late.sent(f"c{i}", 0.001 * i)
    # Now BACKLOG unplaced past their due while the stack places others: the figure is
    # the BACKLOG-th most overdue's (c2, sent at 2 ms).
    assert late.overdue(0.023) == pytest.approx(0.021)
    late.sent("b0", 0.023)  # a resend is due from now: one fewer overdue
    assert late.overdue(0.023) == 0.0


def test_the_overhead_cap_counts_what_waits_on_the_control_plane():
    late = Lateness(overhead_s=0.02)
    late.cap, late._late_at = 4.0, 0.0  # as a cut just left it
    for i in range(4):
        late.sent(f"q{i}", 0.0)
    assert late.full(0.0)
    late.placed("q0", 0.001, est_ttft_s=0.5)  # in an engine's queue: admission's to bound
    late.placed("q1", 0.001, est_ttft_s=0.005)  # an engine about to answer: counted
    assert late.counted == 3 and len(late) == 4 and not late.full(0.001)
    late.placed("q2", 0.001, est_ttft_s=0.3)
    late.placed("q3", 0.001, est_ttft_s=0.3)
    # q1's first token is due at once (0.006), and not q0's, q2's or q3's: a slow engine
    # is no overdue, an instant answer that is not coming is (with as many more, a
    # backlog).
    assert late.overdue(0.02) == 0.0
    for i in range(4, 4 + BACKLOG - 1):
        late.sent(f"q{i}", 0.0)
        late.placed(f"q{i}", 0.001, est_ttft_s=0.005)
    assert late.overdue(0.02) == pytest.approx(0.014)
    for i in range(4, 4 + BACKLOG - 1):
        late.done(f"q{i}")
    late.sent("q2", 0.02)  # resent: back on the control plane
    late.sent("q0", 0.02)  # resent (its worker died): the control plane's again
    assert late.counted == 3 and not late.full(0.02)
    late.sent("q3", 0.02)
    assert late.counted == 4 and late.full(0.02)
    judged = Lateness(limit_s=0.02, overhead_s=0.02)  # by the estimate, every wait counts
    judged.sent("e", 0.0)
    judged.placed("e", 0.001, est_ttft_s=0.5)
    assert judged.counted == 1


def test_no_limit_no_cap():
    late = Lateness()
    for i in range(5000):
        late.sent(f"r{i}", 0.0)
    late.first_token("r0", 10.0)
    assert late.cap == CAP_MAX and not late.full(10.0)


@pytest.fixture
async def make(nats_url):
    made = []

    async def build(max_lateness_s: float, max_overhead_s: float = 0.0):
        clock = ManualClock()
        cfg = GatewayConfig(
            port=0,
            durable_intake=False,
            max_prompt_tokens=64,
            max_tokens_limit=100,
            max_model_len=128,
            sweep_interval_s=0,
            migration_limit=0,
            max_lateness_s=max_lateness_s,
            max_overhead_s=max_overhead_s,
        )
        nc_gw, nc_be = await nats.connect(nats_url), await nats.connect(nats_url)
        gw = await Gateway(cfg, nc_gw, tokenizer=TOK, clock=clock).start()

        async def hold(b, req, reply):  # answered only when the test says
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


def accepted(req, est: float) -> Accepted:
    return Accepted(
        request_id=req.request_id, prefill_instance="p0", decode_instance="d0", est_ttft_s=est
    )


async def refused(http, gw, backend) -> str:
    status, headers, body = await post(http, gw)
    assert status == 429 and headers["Retry-After"] == "1", (status, body)
    assert body["error"]["code"] == "rate_limit_exceeded"
    assert backend.requests.empty()  # turned away before it reached the bus
    return body["error"]["message"]


async def test_overdue_first_tokens_turn_new_requests_away(make):
    gw, backend, http, clock = await make(max_lateness_s=0.05)
    waiting = [asyncio.ensure_future(post(http, gw))]
    r1, reply1 = await backend.requests.get()
    clock.advance(0.04)  # within the limit: the next request is sent too
    waiting.append(asyncio.ensure_future(post(http, gw)))
    r2, reply2 = await backend.requests.get()
    clock.advance(0.02)  # r1 unplaced for 0.06 s
    assert "60 ms overdue" in await refused(http, gw, backend)
    # Both placed with a 1 s estimate: nothing is due for a second, requests go through.
    await backend.send(reply1, accepted(r1, 1.0))
    await backend.send(reply2, accepted(r2, 1.0))
    await until(lambda: gw.router.lateness.overdue(clock.now()) == 0.0)
    waiting.append(asyncio.ensure_future(post(http, gw)))
    r3, reply3 = await backend.requests.get()
    await backend.send(reply3, accepted(r3, 5.0))
    await until(lambda: gw.router.lateness._due.get(r3.request_id, 0) > clock.now())
    clock.advance(1.1)  # r1 and r2 placed, first tokens 0.1 s past their estimates
    assert "100 ms overdue" in await refused(http, gw, backend)
    # Their first tokens come: r3 is not due for another 3.9 s.
    await backend.send(reply1, Tokens(request_id=r1.request_id, token_ids=[5], index=0))
    await backend.send(reply2, Tokens(request_id=r2.request_id, token_ids=[5], index=0))
    await until(lambda: gw.router.lateness.overdue(clock.now()) == 0.0)
    waiting.append(asyncio.ensure_future(post(http, gw)))
    await backend.requests.get()  # sent, not refused
    for t in waiting:
        t.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)


async def test_a_burst_past_the_cap_is_turned_away_by_count(make):
    gw, backend, http, clock = await make(max_lateness_s=0.05)
    gw.router.lateness.cap = CAP_MIN  # as late first tokens left it, just now
    gw.router.lateness._late_at = clock.now()
    waiting = []
    for _ in range(CAP_MIN):
        waiting.append(asyncio.ensure_future(post(http, gw)))
        await backend.requests.get()
    # nothing is overdue (no time passed): the count alone turns the fifth away
    assert gw.router.lateness.overdue(clock.now()) == 0.0
    assert "4 requests wait for their first token" in await refused(http, gw, backend)
    assert metrics.WAIT_CAP._value.get() == CAP_MIN  # exported as it turned one away
    for t in waiting:
        t.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)


def overhead_seen() -> tuple[float, float]:
    """The control-plane overhead histogram's count and sum (process-wide)."""
    got = {
        x.name: x.value
        for m in metrics.CONTROL_OVERHEAD.collect()
        for x in m.samples
        if x.name.endswith(("_count", "_sum"))
    }
    count = next(v for k, v in got.items() if k.endswith("_count"))
    return count, next(v for k, v in got.items() if k.endswith("_sum"))


async def test_the_overhead_gate_judges_the_control_plane_not_the_engine(make):
    gw, backend, http, clock = await make(max_lateness_s=0.0, max_overhead_s=0.02)
    waiting, unplaced = [], []
    for _ in range(BACKLOG):
        waiting.append(asyncio.ensure_future(post(http, gw)))
        unplaced.append(await backend.requests.get())
    r1, reply1 = unplaced[0]
    clock.advance(0.03)  # unplaced for 30 ms, and nothing placed: not a backlog
    waiting.append(asyncio.ensure_future(post(http, gw)))
    r0, reply0 = await backend.requests.get()
    await backend.send(reply0, accepted(r0, 0.1))  # placed after the others were sent
    await until(lambda: gw.router.lateness.overdue(clock.now()) > 0)
    assert "30 ms overdue" in await refused(http, gw, backend)  # a backlog
    await backend.send(reply1, accepted(r1, 0.1))
    # One fewer overdue than a backlog: the rest is a hiccup, and requests go in.
    await until(lambda: gw.router.lateness.overdue(clock.now()) == 0.0)
    for r, reply in unplaced[1:]:
        await backend.send(reply, accepted(r, 0.1))
    clock.advance(10.0)  # a slow engine, 10 s past its estimate: requests still go in
    waiting.append(asyncio.ensure_future(post(http, gw)))
    r2, reply2 = await backend.requests.get()
    await backend.send(reply2, accepted(r2, 0.1))
    cap = gw.router.lateness.cap = 10.0
    count, total = overhead_seen()
    # r1's first token: 10.03 s since sent, 10.02 of them the engine's.
    await backend.send(
        reply1, Tokens(request_id=r1.request_id, token_ids=[5], index=0, engine_s=10.02)
    )
    await until(lambda: gw.router.lateness.cap != cap)
    assert gw.router.lateness.cap == pytest.approx(cap + 1 / cap)
    clock.advance(0.05)  # r2's: 50 ms since sent, none of it the engine's
    await backend.send(
        reply2, Tokens(request_id=r2.request_id, token_ids=[5], index=0, engine_s=0.0)
    )
    await until(lambda: gw.router.lateness.cap == CAP_MIN)
    # What it judged is exported: 10 ms and 50 ms of overhead.
    count2, total2 = overhead_seen()
    assert count2 == count + 2 and total2 - total == pytest.approx(0.06)
    for t in waiting:
        t.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)


async def test_off_when_both_are_zero(make):
    gw, backend, http, clock = await make(max_lateness_s=0.0)
    held = asyncio.ensure_future(post(http, gw))
    await backend.requests.get()
    clock.advance(3600.0)
    second = asyncio.ensure_future(post(http, gw))
    await backend.requests.get()  # an hour overdue, and still sent
    for t in (held, second):
        t.cancel()
    await asyncio.gather(held, second, return_exceptions=True)
