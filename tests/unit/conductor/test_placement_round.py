"""services.conductor.placement_round: store exclusions from the policy's node maps, and
the ordered store liveness behind ShadowView.down."""

from hypothesis import given, settings
from hypothesis import strategies as st

from bus_schemas.load import DecodeLoad, PrefillLoad
from services.common.clock import ManualClock
from services.common.cost_model import CostModel
from services.common.liveness import OrderedLiveness
from services.conductor import placement_round
from services.conductor.migrated_placement import away_from_stores
from services.conductor.placement_policy import PlacementPolicy, PlacementRequest

BS = 512


def _policy(clock: ManualClock) -> PlacementPolicy:
    p = PlacementPolicy(clock, CostModel())
    for i, node in enumerate(("n0", "n1", "n0")):
        p.observe_prefill(PrefillLoad(f"p{i}", node, 0, 0, 0.1 * i, clock.now()))
    for i, node in enumerate(("n0", "n2")):
        p.observe_decode(DecodeLoad(f"d{i}", node, 1 + 5 * i, 0, 128, 100, 0.02, clock.now()))
    return p


def test_a_down_store_takes_its_nodes_instances_and_prefix_out():
    clock = ManualClock(0.0)
    p = _policy(clock)
    req = PlacementRequest("r", 8 * BS, tuple(range(8)), BS)
    placed = placement_round.place(p, req, lambda h: {"n0": 8, "n1": 2}, down={"n0"})
    assert isinstance(placed, placement_round.Placed)
    pl = placed.placement
    # p0 and p2 (node n0) and d0 (n0) are out, and n0 is no source to pull from.
    assert (pl.prefill_instance, pl.decode_instance) == ("p1", "d1")
    assert pl.remote is None and pl.prefix_blocks == 2
    assert placed.task.expected_hit_blocks == 2 and placed.task.source is None
    # The same as the exclusions built from every instance's node.
    q = _policy(clock)
    ex = away_from_stores(
        {},
        {"n0"},
        {i: ld.node for i, ld in q.loads.prefill.items()},
        {i: ld.node for i, ld in q.loads.decode.items()},
    )
    assert q.place(req, {"n0": 8, "n1": 2}, **ex) == pl
    assert p.on_nodes("prefill", ["n0"]) == {"p0": "n0", "p2": "n0"}
    # An instance that moved to another node leaves the old node's map.
    p.observe_prefill(PrefillLoad("p2", "n3", 0, 0, 0.0, clock.now()))
    assert p.on_nodes("prefill", ["n0", "n3"]) == {"p0": "n0", "p2": "n3"}


def test_placement_trusts_the_hashes_admission_checked():
    """Admission is the one check of the hash count (tests/unit/admission); placement
    takes the field as it comes for its block size, and computes it only for another
    size or none."""
    from bus_schemas.requests import GenerateRequest
    from services.common.hashing import block_hashes

    tokens = list(range(100))
    as_given = placement_round.request_for(
        GenerateRequest(request_id="r", prompt_token_ids=tokens, block_size=32, block_hashes=[7]),
        32,
    )
    assert as_given.block_hashes == (7,)  # not checked again, not recomputed
    for other in (
        GenerateRequest(request_id="r", prompt_token_ids=tokens, block_size=16, block_hashes=[7]),
        GenerateRequest(request_id="r", prompt_token_ids=tokens),
    ):
        p = placement_round.request_for(other, 32)
        assert p.block_hashes == tuple(block_hashes(tokens, 32)) and p.num_tokens == 100


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["seen", "forget", "tick", "prune"]),
            st.integers(0, 6),
            st.floats(0, 3),
        ),
        max_size=40,
    )
)
def test_ordered_liveness_finds_the_silent_ones(ops):
    clock = ManualClock(0.0)
    live = OrderedLiveness(clock, dead_after_s=2.0)
    for op, i, dt in ops:
        if op == "seen":
            live.seen(f"s{i}")
        elif op == "forget":
            live.forget(f"s{i}")
        elif op == "prune":
            live.prune(4.0)
        else:
            clock.advance(dt)
        silent = {n for n in (f"s{k}" for k in range(7)) if live.known(n) and not live.alive(n)}
        assert set(live.silent()) == silent


def test_prune_forgets_silent_instances_in_the_orders_too():
    clock = ManualClock(0.0)
    p = _policy(clock)
    clock.advance(5.0)
    p.observe_prefill(PrefillLoad("p1", "n1", 0, 0, 0.0, clock.now()))
    p.observe_decode(DecodeLoad("d1", "n2", 1, 0, 128, 100, 0.02, clock.now()))
    clock.advance(3.0)  # p0, p2, d0 silent 8 s; p1, d1 3 s
    assert p.prune(4.0) == 3
    assert [i for _, i in p.orders.prefill] == ["p1"]
    assert [i for _, i in p.orders.decode] == ["d1"]
    assert p.on_nodes("prefill", ["n0", "n1"]) == {"p1": "n1"}
    assert p.orders.on_node == {"n1": {"p1"}} and p.orders.decode_on_node == {"n2": {"d1"}}
