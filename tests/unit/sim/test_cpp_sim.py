"""The simulator runs a request placed on a CPP group as a pipeline across the group's
instances, with exactly the timing the conductor's policy estimated."""

from perigee.sim.pipeline_gang import ttft_buckets
from perigee.sim.simulator import SimConfig, Simulator
from perigee.trace import TraceRequest
from services.common.cost_model import CostModel
from services.policy import chunk_timing

COST = CostModel()
LONG = 180 * 512 + 17
SHORT = 3 * 512


def trace(*reqs):
    """(time, tokens, first hash id) -> one-token outputs, distinct blocks per request."""
    return [TraceRequest(t, n, 1, tuple(range(h, h + n // 512))) for t, n, h in reqs]


def run(reqs, x, prefill=4, **kw):
    cfg = SimConfig(prefill=prefill, decode=1, cpp_group=x, output_tokens=1, **kw)
    return Simulator(trace(*reqs), cfg).run()


def test_a_long_prompt_runs_as_a_pipeline_with_the_policys_timing():
    one = run([(0.0, LONG, 0)], 1)
    four = run([(0.0, LONG, 0)], 4)
    r1, r4 = one.requests[0], four.requests[0]
    assert r1.state == r4.state == "DONE"
    assert four.pipelined == {"r0"} and one.pipelined == set()
    assert r1.ttft_s == COST.prefill_time(LONG)
    timing = chunk_timing.pipeline_timing([COST] * 4, LONG, 0, chunk_timing.DEFAULT_CHUNK_TOKENS)
    assert r4.ttft_s == timing.ttft_s
    assert r4.ttft_s < 0.4 * r1.ttft_s
    # every member computed its stage: the GPU time is the chunked prefill's, spread
    gpu = [p.gpu_s for p in four.prefills.values()]
    assert gpu == list(timing.stage_compute_s)
    # the KV went to the decode node from the four stages' links, all of it
    assert sum(n.link.bytes_moved for n in four.cluster.nodes.values()) == COST.kv_bytes(LONG)


def test_a_short_prompt_stays_on_one_instance_and_is_no_slower():
    one = run([(0.0, SHORT, 0)], 1)
    four = run([(0.0, SHORT, 0)], 4)
    assert four.pipelined == set()
    assert four.requests[0].ttft_s == one.requests[0].ttft_s == COST.prefill_time(SHORT)


def test_a_busy_member_delays_its_stage_and_frees_the_others():
    # a short request lands first on the first instance; the long one then pipelines
    # with that member as the last stage, and both complete
    sim = run([(0.0, 20 * 512, 0), (0.001, LONG, 1000)], 4, prefill=4)
    assert [r.state for r in sim.requests] == ["DONE", "DONE"]
    assert sim.pipelined == {"r1"}
    busy = sim.requests[0].prefill_instance
    assert sim.placement.stats["placed"] == 2
    # the long request's last stage is the instance the short one occupied: it ran the
    # short request, then the stage's chunks one by one
    chunks = chunk_timing.chunk_bounds(LONG, 0, chunk_timing.DEFAULT_CHUNK_TOKENS)
    assert sim.prefills[busy].done == 1 + len(chunks)


def test_buckets_report_mean_ttft_per_group_size():
    one = run([(0.0, LONG, 0), (0.0, SHORT, 1000)], 1, prefill=8)
    four = run([(0.0, LONG, 0), (0.0, SHORT, 1000)], 4, prefill=8)
    b = ttft_buckets({1: one.requests, 4: four.requests})
    assert [(r["min_tokens"], r["max_tokens"], r["requests"]) for r in b] == [
        (0, 8192, 1),
        (8192, 16384, 0),
        (16384, 32768, 0),
        (32768, 65536, 0),
        (65536, None, 1),
    ]
    assert b[4]["ttft_s"]["1"] == COST.prefill_time(LONG)
    assert b[4]["ttft_s"]["4"] == four.requests[0].ttft_s
    assert b[0]["ttft_s"]["4"] == b[0]["ttft_s"]["1"] == COST.prefill_time(SHORT)
    assert b[1]["ttft_s"] == {"1": None, "4": None}
    assert b[4]["within_ttft"] == {"1": 0.0, "4": 1.0}  # 13.3 s on one node, 4.0 s on four


def test_a_short_request_on_a_member_runs_between_two_chunks_of_the_pipeline():
    # every instance is a stage: the short request arriving mid-pipeline lands on one
    sim = run([(0.0, LONG, 0), (2.0, SHORT, 1000)], 4, prefill=4)
    long_, short = sim.requests
    assert [long_.state, short.state] == ["DONE", "DONE"] and sim.pipelined == {"r0"}
    chunks = chunk_timing.chunk_bounds(LONG, 0, chunk_timing.DEFAULT_CHUNK_TOKENS)
    one_chunk = max(COST.prefill_time(b, a) / 4 for a, b in chunks)
    # it waits at most for the chunk in progress on its member, not for the stage
    assert short.ttft_s <= one_chunk + COST.prefill_time(SHORT)
    # and the pipeline is stretched by at most its compute (here not at all: its member
    # was stage 0, which runs ahead of the stages after it)
    timing = chunk_timing.pipeline_timing([COST] * 4, LONG, 0, chunk_timing.DEFAULT_CHUNK_TOKENS)
    assert timing.ttft_s <= long_.ttft_s <= timing.ttft_s + COST.prefill_time(SHORT)
