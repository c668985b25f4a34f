"""BlockPool by hand: exact moves, exact tiers, exact events (ManualClock)."""

from bus_schemas.control import Refused, TxAllocate, TxDone, TxRole
from bus_schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from bus_schemas.requests import Retention
from perigee.sim.cluster import Cluster
from services.common.clock import ManualClock
from services.common.cost_model import CostModel
from services.store.node.server import StoreService
from services.store.pool.block_pool import Allocation, BlockPool
from services.store.pool.tier_policy import Move, Tier
from tests.unit.store.test_store_block_pool import with_events

D, S, V = Tier.DRAM, Tier.SSD, Tier.VRAM


def test_the_store_and_the_simulator_build_the_same_pool():
    node = Cluster(cost=CostModel(), clock=ManualClock(), block_size=4).add_node(
        "p0", 64, "prefill"
    )
    store = StoreService(None, node="s0", capacity_blocks=4)  # type: ignore[arg-type]
    assert type(node.pool) is type(store.pool) is BlockPool
    assert node.pool.lower == [] and store.pool.lower == []  # no tier: the simple case


def make(dram=2, ssd=2, vram=0, clock=None, writeback=False) -> BlockPool:
    return BlockPool(
        dram,
        1,
        clock or ManualClock(),
        "t-",
        ssd_capacity=ssd,
        vram_capacity=vram,
        writeback=writeback,
    )


def req(hashes, n=None, role=TxRole.PREFILL, **kw) -> TxAllocate:
    return TxAllocate(
        request_id="r",
        role=role,
        block_hashes=hashes,
        num_tokens=len(hashes) if n is None else n,
        **kw,
    )


def put(pool, hashes, **kw):
    a, ev = with_events(pool, pool.allocate(req(hashes, **kw)))
    assert isinstance(a, Allocation), a
    done, ev2 = with_events(pool, pool.commit(a.tx_id))
    assert isinstance(done, TxDone)
    return a, ev + ev2


def test_dram_pressure_demotes_to_ssd_and_a_hit_promotes_back():
    pool = make()
    put(pool, [1])
    put(pool, [2])
    assert pool.take_moves() == []
    a, events = put(pool, [3])  # DRAM full: 1 (LRU) goes to SSD, nothing leaves the node
    assert events == [BlockStored(block_hashes=[3])]
    assert pool.take_moves() == [Move(1, D, 0, S, 0)]
    assert (pool.where(1), pool.where(3), a.slots) == ([S], [D], [0])
    # 1 is a hit on SSD: promoted (held there meanwhile); 4 is new. Room for both: 2 goes
    # to SSD, then 3 takes SSD's LRU slot from 2, which leaves the node.
    b, events = with_events(pool, pool.allocate(req([1, 4])))
    assert b == Allocation(tx_id="t-4", slots=[1, 0], hit_blocks=1)
    assert events == [BlockRemoved(block_hashes=[2])]
    assert pool.take_moves() == [Move(2, D, 1, S, 1), Move(3, D, 0, S, 1), Move(1, S, 0, D, 1)]
    assert (pool.where(1), pool.where(3), pool.lock_count(1)) == ([D, S], [S], 1)
    assert pool.counters["promoted"] == 1 and pool.counters["demoted"] == 3


def test_context_cache_is_offloaded_not_evicted_and_never_lost_while_pinned():
    clock = ManualClock()
    pool = make(dram=1, ssd=1, clock=clock)
    put(pool, [7], retention=Retention.CONTEXT_CACHE, context_ttl_s=10.0)
    assert pool.lock_count(7) == 1 and pool.eviction_order() == []
    a, events = put(pool, [8])  # LRU empty: the pinned block is offloaded to SSD
    assert events == [BlockStored(block_hashes=[8])]
    assert pool.take_moves() == [Move(7, D, 0, S, 0)]
    assert pool.where(7) == [S] and pool.ssd.pinned == {7}
    refused, events = with_events(
        pool, pool.allocate(req([9, 10]))
    )  # SSD holds only a pinned block
    assert isinstance(refused, Refused) and refused.reason == "capacity" and events == []
    b, events = with_events(
        pool, pool.allocate(req([9]))
    )  # 8 has no lower room: it is evicted, 7 stays
    assert events == [BlockRemoved(block_hashes=[8])]
    pool.abort(b.tx_id)
    c, _ = with_events(pool, pool.allocate(req([7])))  # a hit on the pinned SSD block promotes it
    assert c.hit_blocks == 1 and pool.take_moves() == [Move(7, S, 0, D, 0)]
    assert pool.lock_count(7) == 2  # the transaction and the pin
    pool.commit(c.tx_id)
    clock.advance(10.0)
    pool.expire()
    assert pool.lock_count(7) == 0 and pool.ssd.pinned == set() and pool.eviction_order() == [7]


def test_ephemeral_is_not_cached_on_any_tier():
    pool = make(writeback=True)
    put(pool, [1], retention=Retention.EPHEMERAL)
    assert with_events(pool, pool.writebacks()) == ([], []) and pool.cached_blocks == 0


def test_writeback_locks_the_dram_copy_then_eviction_is_free():
    pool = make(dram=1, ssd=2, writeback=True)
    put(pool, [1])
    moves, events = with_events(pool, pool.writebacks())
    assert (moves, events) == ([Move(1, D, 0, S, 0)], [])
    assert pool.lock_count(1) == 1
    refused, _ = with_events(
        pool, pool.allocate(req([2]))
    )  # the only DRAM block is being written back
    assert isinstance(refused, Refused)
    pool.writeback_done(1, ok=True)
    assert pool.lock_count(1) == 0 and pool.where(1) == [D, S] and pool.ssd_dirty
    a, events = with_events(pool, pool.allocate(req([2])))
    assert events == [] and pool.take_moves() == []  # 1 already on SSD: DRAM copy dropped
    assert pool.where(1) == [S] and pool.ssd_entries() == [(1, 0, None)]


def test_failed_writeback_frees_the_ssd_slot():
    pool = make(dram=2, ssd=1, writeback=True)
    put(pool, [1])
    pool.writebacks()
    pool.writeback_done(1, ok=False)
    assert pool.where(1) == [D] and len(pool.ssd) == 0 and pool.lock_count(1) == 0


def test_ssd_pressure_evicts_its_lru_and_that_leaves_the_node():
    pool = make(dram=1, ssd=1)
    put(pool, [1])
    put(pool, [2])  # 1 -> SSD
    _, events = put(pool, [3])  # 2 -> SSD evicts 1 from SSD: gone
    assert events == [BlockRemoved(block_hashes=[1]), BlockStored(block_hashes=[3])]
    assert pool.take_moves() == [Move(1, D, 0, S, 0), Move(2, D, 0, S, 0)]
    assert pool.dump() == ([2, 3], None)


def test_vram_sits_between_dram_and_ssd_and_its_victims_cascade():
    pool = make(dram=1, ssd=1, vram=1)
    put(pool, [1])
    put(pool, [2])  # 1 -> VRAM
    _, events = put(pool, [3])  # 2 -> VRAM, which sends 1 on to SSD first
    assert events == [BlockStored(block_hashes=[3])]
    assert pool.take_moves() == [Move(1, D, 0, V, 0), Move(1, V, 0, S, 0), Move(2, D, 0, V, 0)]
    assert (pool.where(1), pool.where(2), pool.where(3)) == ([S], [V], [D])


def test_source_tx_promotes_lower_blocks():
    pool = make(dram=2, ssd=2)
    put(pool, [1, 2])
    put(pool, [3, 4])  # 1, 2 -> SSD
    pool.take_moves()
    src, events = with_events(pool, pool.allocate(req([1, 2], n=0, role=TxRole.SOURCE)))
    assert src == Allocation(tx_id="t-3", slots=[0, 1], hit_blocks=2)
    assert events == [BlockRemoved(block_hashes=[4, 3])]  # SSD holds 1 and 2 for the promotion
    assert pool.take_moves() == [Move(1, S, 1, D, 0), Move(2, S, 0, D, 1)]
    missing, _ = with_events(pool, pool.allocate(req([1, 99], n=0, role=TxRole.SOURCE)))
    assert isinstance(missing, Refused) and missing.reason == "missing"


def test_clear_drops_everything_not_in_use():
    pool = make(dram=2, ssd=2)
    put(pool, [1])
    put(pool, [2])
    put(pool, [3])  # 1 -> SSD
    a, _ = with_events(pool, pool.allocate(req([3])))  # 3 locked by an open tx
    removed, events = with_events(pool, pool.clear())
    assert removed == [1, 2] and events == [BlockRemoved(block_hashes=[1, 2])]
    pool.abort(a.tx_id)
    removed, events = with_events(pool, pool.clear())
    assert removed == [3] and events == [AllBlocksCleared()]
    assert pool.cached_blocks == 0 and pool.free_blocks == 2


def test_remove_skips_blocks_in_use():
    pool = make()
    put(pool, [1])
    put(pool, [2])
    a, _ = with_events(pool, pool.allocate(req([2])))
    removed, busy, events = with_events(pool, pool.remove([1, 2, 5]))
    assert (removed, busy, events) == ([1], [2], [BlockRemoved(block_hashes=[1])])


def test_restore_loads_ssd_entries_and_their_pins():
    clock = ManualClock(100.0)
    pool = make(dram=1, ssd=3, clock=clock)
    loaded, events = with_events(
        pool, pool.restore([(5, 2, None), (6, 0, 150.0), (7, 1, 50.0), (5, 1, None)])
    )
    assert (loaded, events) == ([5, 6, 7], [BlockStored(block_hashes=[5, 6, 7])])
    assert pool.ssd.pinned == {6} and pool.prefix_hits([5, 6, 7]) == 3
    assert sorted(pool.ssd_entries()) == [(5, 2, None), (6, 0, 150.0), (7, 1, None)]
