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
