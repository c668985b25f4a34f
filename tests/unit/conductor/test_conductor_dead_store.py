"""A store that dies (issue 13 item 2), in the conductor's pure parts with a manual
clock: the shadow view calls a node down once its store, seen before, goes silent (and
after the sweep drops it) until it shows up again; placement then keeps that node's
instances out (services.conductor.migrated_placement.away_from_stores): the request goes to
another node's instances, or gets 503 when there is none."""

from bus_schemas.control import StoreInfo
from bus_schemas.kv_events import BlockStored, EventBatch
from bus_schemas.load import DecodeLoad, PrefillLoad
from bus_schemas.requests import ErrorCode
from services.common.clock import ManualClock
from services.common.cost_model import CostModel
from services.conductor.migrated_placement import away_from_stores
from services.conductor.placement_policy import (
    Placement,
    PlacementPolicy,
    PlacementRequest,
    Rejection,
)
from services.conductor.shadow import ShadowView

BS = 32
HASHES = (11, 12, 13)


def info(node: str, epoch: int = 5, seq: int = 1) -> StoreInfo:
    return StoreInfo(
        node=node,
        epoch=epoch,
        seq=seq,
        data_addr="tcp://x:1",
        shm_name="s",
        block_size=BS,
        block_bytes=1,
        capacity_blocks=10,
        used_blocks=0,
    )


def batch(node: str, seq: int, *hashes: int, epoch: int = 5) -> EventBatch:
    return EventBatch(
        node=node, epoch=epoch, seq=seq, ts=0.0, events=[BlockStored(block_hashes=list(hashes))]
    )


def test_away_from_stores_adds_the_down_nodes_instances_and_sources():
    ex = away_from_stores(
        {"exclude_decode": ("decode-9",)},
        {"p0"},
        {"prefill-0": "p0", "prefill-1": "p1"},
        {"decode-0": "d0"},
    )
    assert ex == {
        "exclude_decode": ("decode-9",),
        "exclude_prefill": ("prefill-0",),
        "exclude_sources": ("p0",),
    }
    assert away_from_stores({}, set(), {"prefill-0": "p0"}, {}) == {}


def test_a_silent_store_is_down_until_it_shows_up_again():
    clock = ManualClock(0.0)
    v = ShadowView(None, None, clock, store_dead_after_s=5.0)  # type: ignore[arg-type]
    v.caught_up.set()
    v.apply(batch("p0", 1, *HASHES))
    v.apply(batch("p1", 1, 11))
    assert v.down() == set()
    clock.advance(4.0)
    v.on_info(info("p1"))
    clock.advance(2.0)  # p0 silent for 6 s, p1 for 2 s
    assert v.down() == {"p0"}
    assert v.match(list(HASHES)) == {"p1": 1}
    assert v.sweep() == ["p0"]
    assert v.down() == {"p0"}  # still down once forgotten by the index
    v.apply(batch("p0", 1, 11, epoch=6))  # restarted: a new epoch's first batch
    assert v.down() == set()
    assert v.index.state("p0") == (6, 1) and v.match(list(HASHES)) == {"p0": 1, "p1": 1}


def policy(clock: ManualClock, prefills: dict[str, str]) -> PlacementPolicy:
    pol = PlacementPolicy(clock, CostModel())
    for inst, node in prefills.items():
        pol.observe_prefill(
            PrefillLoad(
                instance=inst,
                node=node,
                queue_len=0,
                queued_tokens=0,
                queued_work_s=0.0,
                ts=clock.now(),
            )
        )
    pol.observe_decode(
        DecodeLoad(
            instance="decode-0",
            node="d0",
            batch_size=0,
            waiting=0,
            max_batch=8,
            kv_tokens=0,
            step_time_s=0.0,
            ts=clock.now(),
        )
    )
    return pol


def place(pol: PlacementPolicy, down: set[str], matches: dict[str, int]):
    ex = away_from_stores(
        {},
        down,
        {i: ld.node for i, ld in pol.loads.prefill.items()},
        {i: ld.node for i, ld in pol.loads.decode.items()},
    )
    req = PlacementRequest(
        request_id="r", num_tokens=3 * BS + 5, block_hashes=HASHES, block_size=BS
    )
    return pol.place(req, matches, **ex)


def test_placement_leaves_out_a_node_whose_store_is_down():
    clock = ManualClock(100.0)
    pol = policy(clock, {"prefill-0": "p0", "prefill-1": "p1"})
    # p0 holds the whole prefix and would win; its store is down.
    assert place(pol, set(), {"p0": 3}).prefill_instance == "prefill-0"
    d = place(pol, {"p0"}, {"p0": 3})
    assert isinstance(d, Placement) and d.prefill_instance == "prefill-1" and d.remote is None


def test_no_instance_left_is_a_clear_503():
    clock = ManualClock(100.0)
    pol = policy(clock, {"prefill-0": "p0"})
    d = place(pol, {"p0"}, {})
    assert isinstance(d, Rejection) and d.code == ErrorCode.UNAVAILABLE
    assert "prefill" in d.reason
    d = place(pol, {"d0"}, {})
    assert isinstance(d, Rejection) and d.code == ErrorCode.UNAVAILABLE and "decode" in d.reason


def test_a_prefix_many_stores_hold_is_matched_less_the_silent_and_the_unseen():
    """Issue 27: 20 stores hold the prefix (one NodeGroup in the index's match); the
    view's match leaves out the 3 gone silent and the one known only from the stream's
    history, exactly as a check of every store would, and returns the index's own
    match when every holder is alive."""
    clock = ManualClock(0.0)
    v = ShadowView(None, None, clock, store_dead_after_s=5.0)  # type: ignore[arg-type]
    v.caught_up.set()
    for i in range(20):
        v.apply(batch(f"p{i:02d}", 1, *HASHES))
    assert v.match(list(HASHES)) == {f"p{i:02d}": len(HASHES) for i in range(20)}
    clock.advance(4.0)
    for i in range(3, 20):
        v.on_info(info(f"p{i:02d}"))
    clock.advance(2.0)  # p00-p02 silent for 6 s
    v.apply(batch("p20", 1, *HASHES), live=False)  # history: no sign of life
    want = {f"p{i:02d}": len(HASHES) for i in range(3, 20)}
    assert v.match(list(HASHES)) == want
    assert all(v.stores.alive(n) for n in v.match(list(HASHES)))
    v.on_info(info("p20"))
    assert v.match(list(HASHES)) == {**want, "p20": len(HASHES)}
