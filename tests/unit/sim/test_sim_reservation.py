"""The simulator reserves store slots as the live prefill instance does
(services.prefill.reserve, through services.common.reservation): when a request's
compute starts, never while it queues; a store short of room is waited for, up to
``reserve_wait_s``, then the request fails at the prefill stage."""

from bus_schemas.control import Refused, TxRole
from perigee.sim.metrics import summarize
from perigee.sim.simulator import SimConfig, Simulator
from tests.unit.sim.test_sim_simulator import FAST, PULL, TOY, B, tr


def sim_of(trace, **kw) -> Simulator:
    return Simulator(trace, SimConfig(**{"prefill": 1, "decode": 1, "cost": FAST, **kw}))


def test_a_queued_request_holds_no_store_slots():
    # TOY: 0.05 s a token: the first compute runs 0 .. 5 s, the second queues behind it
    sim = sim_of([tr(0.0, 100, 1), tr(1.0, 100, 1)], cost=TOY, tbt_slo_s=10.0)
    seen = {}

    def probe():
        r0, r1 = sim.requests
        seen.update(
            running=set(r0.txs),
            queued=dict(r1.txs),
            r1=r1.state,
            open=len(sim.cluster.nodes["n00"].pool.open_txs()),
        )

    sim.loop.at(2.0, probe)
    sim.run()
    assert seen == {"running": {"prefill", "decode"}, "queued": {}, "r1": "QUEUED", "open": 1}
    r0, r1 = sim.requests
    assert r1.started == r0.prefill_end == 5.0
    assert summarize(sim)["completed"] == 2


def two_on_one_small_decode_store(**kw) -> Simulator:
    # Two prefill instances start at once; the decode node has room for one prompt
    # (2 blocks): the second DECODE reservation is refused for capacity until the first
    # request's KV has landed there and been committed.
    trace = [tr(0.0, 2 * B, 1, (1, 2)), tr(0.001, 2 * B, 1, (3, 4))]
    return sim_of(trace, prefill=2, decode_cache_tokens=2 * B, **kw).run()


def test_a_store_short_of_room_is_waited_for():
    sim = two_on_one_small_decode_store()
    r0, r1 = sim.requests
    assert (r0.prefill_instance, r1.prefill_instance) == ("P-n00", "P-n01")
    assert r1.started == 0.001
    # asked again every reserve_retry_s until the first request's KV landed (0.1024 s)
    assert r1.prefill_end > r0.prefill_end
    assert r1.prefill_end - r1.compute_s > r0.prefill_end
    s = summarize(sim)
    assert (s["completed"], s["rejected"]) == (2, 0)


def test_no_room_after_the_wait_fails_the_request_at_prefill():
    sim = two_on_one_small_decode_store(reserve_wait_s=0.0)
    r0, r1 = sim.requests
    assert r0.state == "DONE"
    assert (r1.state, r1.reject_stage) == ("REJECTED", "prefill")
    assert "no room in the store" in r1.reject_reason and "decode" in r1.reject_reason
    assert r1.txs == {} and r1.prefill_end < 0  # its PREFILL grant went back, no compute
    assert not sim.cluster.nodes["n01"].pool.open_txs()
    assert sim.placement.queue_s("P-n01") == 0.0 and sim.inbound["D-n02"] == 0
    assert summarize(sim)["rejected_by"]["prefill"] == 1


def test_a_source_that_lost_the_prefix_is_dropped_and_computed_here():
    trace = [
        tr(0.0, 4 * B, 1, (1, 2, 3, 4)),  # n00
        tr(1.5, 40 * B, 1, tuple(range(100, 140))),  # n00 again: busy
        tr(2.0, 4 * B, 1, (1, 2, 3, 5)),  # placed on n01 to pull 3 blocks from n00
    ]
    sim = sim_of(trace, prefill=2, decode_cache_tokens=0, cost=PULL)
    allocate = sim.cluster.allocate

    def evicted(node, rid, role, hashes, tokens):  # the holder evicted it meanwhile
        if role == TxRole.SOURCE:
            return Refused(reason="missing", message="evicted")
        return allocate(node, rid, role, hashes, tokens)

    sim.cluster.allocate = evicted
    sim.run()
    r2 = sim.requests[2]
    assert r2.prefill_node == "n01" and r2.source is not None and r2.source.node == "n00"
    assert (r2.pull_source, r2.pulled_tokens, r2.cached_tokens) == ("", 0, 0)
    assert r2.compute_s == PULL.prefill_time(4 * B, 0)
    assert set(r2.txs) == set() and r2.state == "DONE"
