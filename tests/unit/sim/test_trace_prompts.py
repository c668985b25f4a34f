from perigee.replay import ReplayOutcome, summarize
from perigee.trace import PromptBuilder, TraceRequest, load_trace, spread_ties


def test_same_hash_id_same_tokens_last_block_cut():
    b = PromptBuilder(block_tokens=8, vocab_size=100)
    r1 = TraceRequest(0.0, 20 * 512 // 8, 1, (0, 1, 2))  # 20 tokens at 8 tokens per id
    r2 = TraceRequest(0.0, 16 * 512 // 8, 1, (0, 1))
    t1, t2 = b.tokens(r1), b.tokens(r2)
    assert len(t1) == 20 and len(t2) == 16
    assert t1[:16] == t2
    assert all(3 <= t < 100 for t in t1)
    assert PromptBuilder(8, 100).tokens(r1) == t1  # deterministic across builders


def test_trace_loads_and_is_ms_timestamps():
    reqs = load_trace(limit=3)
    assert len(reqs) == 3
    assert reqs[0].hash_ids[0] == 0 and reqs[1].hash_ids[0] == 0  # shared first block


def test_tbt_is_mean_of_longest_tenth_and_goodput():
    o = ReplayOutcome(
        ok=True, ttft_s=1.0, gaps=[0.01] * 18 + [0.5, 0.3], prompt_tokens=100, cached_tokens=40
    )
    assert abs(o.tbt_s - 0.4) < 1e-12  # the two longest of 20 gaps
    s = summarize([o, ReplayOutcome(ok=False, status=429)], wall_s=2.0, ttft_slo=30, tbt_slo=0.5)
    assert s["completed"] == 1 and s["rejected"] == 1
    assert s["goodput"]["requests"] == 1
    assert s["cached_token_ratio"] == 0.4


def test_spread_ties_spreads_each_step_evenly_in_file_order():
    reqs = [
        TraceRequest(t, n, 1, ())
        for t, n in [
            (0.0, 1),
            (0.0, 2),
            (0.0, 3),
            (0.0, 4),
            (3.0, 5),
            (6.0, 6),
            (6.0, 7),
            (12.0, 8),
        ]
    ]
    out = spread_ties(reqs)
    # steps 3, 3, 6: the last one (12.0) alone; 6.0's pair spans [6, 12)
    assert [r.timestamp_s for r in out] == [0.0, 0.75, 1.5, 2.25, 3.0, 6.0, 9.0, 12.0]
    assert [r.input_length for r in out] == list(range(1, 9))
    tail = spread_ties(
        [TraceRequest(0.0, 1, 1, ()), TraceRequest(3.0, 1, 1, ()), TraceRequest(3.0, 1, 1, ())]
    )
    assert [r.timestamp_s for r in tail] == [0.0, 3.0, 4.5]  # the last step: the median one
    assert spread_ties([]) == []


def test_the_summary_says_why_requests_failed():
    unsubscribed = '{"error": {"message": "no service is subscribed to perigee.requests"}}'
    outs = [
        ReplayOutcome(ok=False, status=503, error=unsubscribed),
        ReplayOutcome(ok=False, status=503, error=unsubscribed),
        ReplayOutcome(ok=False, status=200, error="{'message': 'decode died'}", expected_tokens=4),
        ReplayOutcome(ok=False, status=0, error="ClientConnectorError()"),
        ReplayOutcome(ok=False, status=429, error='{"error": {"message": "busy"}}'),
    ]
    s = summarize(outs, wall_s=1.0, ttft_slo=30, tbt_slo=0.5)
    assert s["failed"] == 3 and s["cut"] == 1 and s["rejected"] == 1
    assert s["errors"] == {
        "503: no service is subscribed to perigee.requests": 2,
        "200: {'message': 'decode died'}": 1,
        "no answer: ClientConnectorError()": 1,
    }


async def test_replay_waits_for_a_stack_still_starting():
    """A gateway whose stack is starting answers /v1/models 503 + Retry-After: replay
    waits for it (and says so) rather than fail every request; other answers end it."""
    import aiohttp
    import pytest
    from aiohttp import web

    from perigee.replay import models_listed

    answers = [503, 503, 200]
    seen = []

    async def models(request):
        status = answers.pop(0) if answers else 500
        seen.append(status)
        if status == 503:
            body = {"error": {"message": "the stack is starting: no conductor yet"}}
            return web.json_response(body, status=503, headers={"Retry-After": "0"})
        if status == 500:
            return web.json_response({"error": {"message": "boom"}}, status=500)
        return web.json_response({"object": "list", "data": [{"id": "m"}]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with aiohttp.ClientSession() as http:
            assert [m["id"] for m in await models_listed(http, url, {}, wait_s=30)] == ["m"]
            assert seen == [503, 503, 200]
            with pytest.raises(SystemExit, match="answered 500: boom"):
                await models_listed(http, url, {}, wait_s=30)
            answers[:] = [503]
            with pytest.raises(SystemExit, match="answered 503: the stack is starting"):
                await models_listed(http, url, {}, wait_s=0)
            # The model named: an endpoint without the list (here 500) is replayed all
            # the same, as before the wait; a 503 is still waited for.
            answers[:] = [503, 500]
            assert await models_listed(http, url, {}, wait_s=30, required=False) == []
            assert seen[-2:] == [503, 500]
    finally:
        await runner.cleanup()
