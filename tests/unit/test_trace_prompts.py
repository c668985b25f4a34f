from perigee.replay import Outcome, summarize
from perigee.trace import PromptBuilder, TraceRequest, load_trace


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
    o = Outcome(ok=True, ttft_s=1.0, gaps=[0.01] * 18 + [0.5, 0.3], prompt_tokens=100, cached_tokens=40)
    assert abs(o.tbt_s - 0.4) < 1e-12  # the two longest of 20 gaps
    s = summarize([o, Outcome(ok=False, status=429)], wall_s=2.0, ttft_slo=30, tbt_slo=0.5)
    assert s["completed"] == 1 and s["rejected"] == 1
    assert s["goodput"]["requests"] == 1
    assert s["cached_token_ratio"] == 0.4
