"""BlockPool by hand: exact slots, exact eviction order, exact events."""

from bus_schemas.control import Refused, TxAllocate, TxDone, TxRole
from bus_schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from bus_schemas.requests import Retention
from services.common.clock import ManualClock
from services.store.pool.block_pool import Allocation, BlockPool
from services.store.pool.eviction import LRUEviction


def make_pool(
    capacity: int = 8, block_size: int = 4, clock: ManualClock | None = None
) -> BlockPool:
    return BlockPool(capacity, block_size, clock or ManualClock(), id_prefix="t-")


def with_events(pool: BlockPool, result):
    """An operation's result and the KV events it queued: ``(result, events)``, or
    ``(*result, events)`` when it returns a tuple."""
    events = pool.take_events()
    return (*result, events) if isinstance(result, tuple) else (result, events)


def req(hashes: list[int], num_tokens: int, role: TxRole = TxRole.PREFILL, **kw) -> TxAllocate:
    return TxAllocate(
        request_id=kw.pop("request_id", "r"),
        role=role,
        block_hashes=hashes,
        num_tokens=num_tokens,
        **kw,
    )


def alloc(pool: BlockPool, hashes: list[int], num_tokens: int, **kw) -> Allocation:
    result, _ = with_events(pool, pool.allocate(req(hashes, num_tokens, **kw)))
    assert isinstance(result, Allocation), result
    return result


def committed(pool: BlockPool, hashes: list[int], num_tokens: int, **kw) -> Allocation:
    a = alloc(pool, hashes, num_tokens, **kw)
    done, _ = with_events(pool, pool.commit(a.tx_id))
    assert isinstance(done, TxDone)
    return a


def test_lru_policy_order():
    lru: LRUEviction[str] = LRUEviction()
    for k in "abc":
        lru.add(k)
    lru.add("a")  # used again: newest
    assert list(lru) == ["b", "c", "a"]
    assert lru.remove("c") is True and lru.remove("c") is False
    assert lru.victim() == "b" and lru.victim() == "a" and len(lru) == 0


def test_fresh_allocation_has_a_slot_per_block_including_tail():
    pool = make_pool()
    result, events = with_events(pool, pool.allocate(req([11, 12], 10)))
    assert result == Allocation(tx_id="t-1", slots=[0, 1, 2], hit_blocks=0)
    assert events == []
    assert (pool.used_blocks, pool.free_blocks, pool.cached_blocks) == (3, 5, 0)
    assert pool.check_write("t-1", [0, 1, 2]) is None


def test_commit_caches_full_blocks_frees_tail_and_releases_tail_first():
    pool = make_pool()
    a = alloc(pool, [11, 12], 10)
    done, events = with_events(pool, pool.commit(a.tx_id, "r"))
    assert done == TxDone(tx_id="t-1", stored_blocks=2)
    assert events == [BlockStored(block_hashes=[11, 12])]
    assert (pool.slot_of(11), pool.slot_of(12), pool.used_blocks) == (0, 1, 2)
    assert pool.eviction_order() == [12, 11]  # the chain's tail goes first
    assert pool.check_write(a.tx_id, [0]) is not None  # closed transaction


def test_prefix_hit_locks_blocks_and_allocates_the_rest():
    pool = make_pool()
    committed(pool, [11, 12], 10)  # free list afterwards: 3 4 5 6 7 2
    result, events = with_events(pool, pool.allocate(req([11, 12, 13], 13)))
    assert result == Allocation(tx_id="t-2", slots=[0, 1, 3, 4], hit_blocks=2)
    assert events == []
    assert (pool.lock_count(11), pool.lock_count(12)) == (1, 1)
    assert pool.eviction_order() == []
    # hit slots are readable but not writable; new slots are both
    assert pool.check_read("t-2", [0, 1, 3, 4]) is None
    assert pool.check_write("t-2", [3, 4]) is None
    assert pool.check_write("t-2", [0]) is not None
    assert pool.check_read("t-2", [5]) is not None


def test_lru_eviction_order_and_reuse_moves_block_to_newest():
    pool = make_pool(capacity=4, block_size=1)
    committed(pool, [10, 11], 2)  # slots 0 1; LRU 11 10
    committed(pool, [20], 1)  # slot 2; LRU 11 10 20
    assert pool.eviction_order() == [11, 10, 20]
    committed(pool, [10], 1)  # hit on 10: locked, released again as newest
    assert pool.eviction_order() == [11, 20, 10]
    result, events = with_events(pool, pool.allocate(req([30, 31, 32], 3)))
    assert events == [BlockRemoved(block_hashes=[11, 20])]
    assert result == Allocation(tx_id="t-4", slots=[3, 1, 2], hit_blocks=0)
    assert pool.eviction_order() == [10]
    assert pool.counters["evictions"] == 2


def test_locked_block_is_never_evicted_and_refusal_changes_nothing():
    pool = make_pool(capacity=2, block_size=1)
    committed(pool, [1, 2], 2)
    b, events = with_events(
        pool, pool.allocate(req([1], 2))
    )  # hits 1, needs one more slot: evicts 2
    assert events == [BlockRemoved(block_hashes=[2])]
    assert b == Allocation(tx_id="t-2", slots=[0, 1], hit_blocks=1)
    refused, events = with_events(pool, pool.allocate(req([5], 1)))
    assert isinstance(refused, Refused) and refused.reason == "capacity"
    assert events == []
    refused, _ = with_events(pool, pool.allocate(req([1], 3)))  # would hit 1 and need 2 more
    assert isinstance(refused, Refused) and refused.reason == "capacity"
    assert pool.lock_count(1) == 1 and pool.is_cached(1)
    assert pool.stats()["tx_refused"] == 2
    pool.abort(b.tx_id)
    assert pool.eviction_order() == [1] and pool.free_blocks == 1


def test_request_larger_than_the_store_is_refused():
    pool = make_pool(capacity=2, block_size=4)
    refused, _ = with_events(pool, pool.allocate(req([], 9)))
    assert isinstance(refused, Refused) and refused.reason == "capacity"
    assert "need 3" in refused.message


def test_ephemeral_blocks_are_not_cached():
    pool = make_pool()
    committed(pool, [11], 4)
    a = alloc(pool, [11, 12], 9, retention=Retention.EPHEMERAL)
    assert a.hit_blocks == 1
    done, events = with_events(pool, pool.commit(a.tx_id))
    assert done == TxDone(tx_id=a.tx_id, stored_blocks=0)
    assert events == []
    assert not pool.is_cached(12) and pool.lock_count(11) == 0
    assert pool.used_blocks == 1 and pool.eviction_order() == [11]


def test_lease_expiry_aborts_with_manual_clock():
    clock = ManualClock()
    pool = make_pool(clock=clock)
    committed(pool, [11], 4)
    a = alloc(pool, [11, 12], 8, lease_s=5.0)
    clock.advance(4.9)
    assert pool.expire() == []
    clock.advance(0.1)
    assert pool.expire() == [a.tx_id]
    assert pool.lock_count(11) == 0 and pool.used_blocks == 1
    assert pool.counters["tx_expired"] == 1
    refused, _ = with_events(pool, pool.commit(a.tx_id))
    assert isinstance(refused, Refused) and refused.reason == "unknown_tx"
    assert pool.expire(now=100.0) == []


def test_renewal_moves_the_lease_end_and_only_for_open_transactions():
    clock = ManualClock()
    pool = make_pool(clock=clock)
    a = alloc(pool, [11, 12], 8, lease_s=5.0)
    clock.advance(4.0)
    assert pool.renew(a.tx_id, 5.0)  # now ends at 9.0
    assert not pool.renew(a.tx_id, 1.0) or pool.expire(now=8.9) == []  # never moved earlier
    clock.advance(4.9)
    assert pool.expire() == [] and pool.counters["tx_expired"] == 0
    clock.advance(0.1)
    assert pool.expire() == [a.tx_id]
    assert not pool.renew(a.tx_id, 5.0)  # gone: nothing to renew
    assert not pool.renew("t-unknown", 5.0)
    b = alloc(pool, [21], 4, lease_s=5.0)
    assert not pool.renew(b.tx_id, 0.0) and not pool.renew(b.tx_id, float("inf"))


def test_source_role_locks_existing_blocks_and_allocates_nothing():
    pool = make_pool()
    committed(pool, [11, 12], 8)
    src, events = with_events(pool, pool.allocate(req([11, 12], 0, role=TxRole.SOURCE)))
    assert src == Allocation(tx_id="t-2", slots=[0, 1], hit_blocks=2)
    assert events == [] and pool.used_blocks == 2
    assert pool.check_read("t-2", [0, 1]) is None and pool.check_write("t-2", [0]) is not None
    missing, _ = with_events(pool, pool.allocate(req([11, 99], 0, role=TxRole.SOURCE)))
    assert isinstance(missing, Refused) and missing.reason == "missing"
    assert (pool.lock_count(11), pool.lock_count(12)) == (1, 1)
    done, events = with_events(pool, pool.commit("t-2"))
    assert done == TxDone(tx_id="t-2", stored_blocks=0) and events == []
    assert pool.eviction_order() == [12, 11]


def test_duplicate_commit_frees_the_later_copy():
    pool = make_pool()
    a = alloc(pool, [11], 4)
    b = alloc(pool, [11], 4)
    assert (a.slots, b.slots) == ([0], [1])
    assert with_events(pool, pool.commit(a.tx_id)) == (
        TxDone(tx_id=a.tx_id, stored_blocks=1),
        [BlockStored(block_hashes=[11])],
    )
    assert with_events(pool, pool.commit(b.tx_id)) == (TxDone(tx_id=b.tx_id, stored_blocks=0), [])
    assert pool.slot_of(11) == 0 and pool.used_blocks == 1
    assert pool.counters["duplicate_blocks"] == 1
    again, _ = with_events(pool, pool.commit(a.tx_id))
    assert isinstance(again, Refused) and again.reason == "unknown_tx"
    stale, _ = with_events(pool, pool.commit("other-epoch-7"))
    assert isinstance(stale, Refused) and stale.reason == "epoch"


def test_commit_checks_request_id():
    pool = make_pool()
    a = alloc(pool, [11], 4, request_id="r1")
    wrong, _ = with_events(pool, pool.commit(a.tx_id, "r2"))
    assert isinstance(wrong, Refused) and wrong.reason == "bad_request"
    assert pool.commit(a.tx_id, "r1") == TxDone(tx_id=a.tx_id, stored_blocks=1)


def test_abort_frees_new_slots_and_releases_locks():
    pool = make_pool()
    committed(pool, [11], 4)
    a = alloc(pool, [11, 12], 9)
    assert a.slots == [0, 1, 2]
    assert with_events(pool, pool.abort(a.tx_id)) == (TxDone(tx_id=a.tx_id), [])
    assert pool.used_blocks == 1 and pool.lock_count(11) == 0
    assert pool.abort(a.tx_id).reason == "unknown_tx"


def test_context_cache_pins_until_ttl():
    clock = ManualClock()
    pool = make_pool(capacity=2, block_size=1, clock=clock)
    committed(pool, [1], 1, retention=Retention.CONTEXT_CACHE, context_ttl_s=10.0)
    assert pool.lock_count(1) == 1 and pool.eviction_order() == []
    refused, _ = with_events(pool, pool.allocate(req([2, 3], 2)))
    assert isinstance(refused, Refused) and refused.reason == "capacity"
    clock.advance(10.0)
    assert pool.expire() == []
    assert pool.lock_count(1) == 0 and pool.eviction_order() == [1]
    result, events = with_events(pool, pool.allocate(req([2, 3], 2)))
    assert isinstance(result, Allocation) and events == [BlockRemoved(block_hashes=[1])]


def test_bad_requests_are_refused():
    pool = make_pool()
    for bad in (req([1, 2, 3], 8), req([], 0), req([1], 4, lease_s=0.0)):
        result, events = with_events(pool, pool.allocate(bad))
        assert isinstance(result, Refused) and result.reason == "bad_request", bad
        assert events == []
    assert pool.used_blocks == 0 and pool.open_txs() == []


def test_dump_pages_by_hash_cursor():
    pool = make_pool(block_size=1)
    committed(pool, [50, 10, 90, 30], 4)
    assert pool.dump(0, 2) == ([10, 30], 31)
    assert pool.dump(31, 2) == ([50, 90], None)
    assert pool.dump() == ([10, 30, 50, 90], None)


def test_stats_account_for_every_slot():
    pool = make_pool()
    committed(pool, [11, 12], 8)
    alloc(pool, [11], 6)
    s = pool.stats()
    assert s["free_blocks"] + s["cached_blocks"] + s["tx_owned_blocks"] == s["capacity_blocks"] == 8
    assert (s["cached_blocks"], s["tx_owned_blocks"], s["locked_blocks"], s["open_txs"]) == (
        2,
        1,
        1,
        1,
    )


def test_each_operation_hands_its_owner_one_batch_of_its_own_events():
    pool = make_pool(capacity=2, block_size=1)
    batches: list[list] = []
    pool.on_change = lambda: batches.append(pool.take_events())
    a = pool.allocate(req([1], 1))
    pool.commit(a.tx_id)
    b = pool.allocate(req([2], 1))
    pool.commit(b.tx_id)
    c = pool.allocate(req([3], 1))  # the pool is full: 1 (LRU) leaves the node
    pool.abort(c.tx_id)
    pool.expire()
    assert pool.remove([2, 9]) == ([2], [])
    assert pool.clear() == []  # nothing left to drop
    assert batches == [
        [],
        [BlockStored(block_hashes=[1])],
        [],
        [BlockStored(block_hashes=[2])],
        [BlockRemoved(block_hashes=[1])],
        [],
        [],
        [BlockRemoved(block_hashes=[2])],
        [AllBlocksCleared()],
    ]
    pool.renew("nope", 1.0)  # reads and renewals are not operations: no call
    assert len(batches) == 9 and pool.take_events() == []


def test_a_pool_without_event_readers_queues_none():
    pool = BlockPool(2, 1, ManualClock(), kv_events=False)
    for h in (1, 2, 3):
        a = pool.allocate(req([h], 1))
        assert isinstance(a, Allocation)
        pool.commit(a.tx_id)
    assert pool.take_events() == [] and pool.counters["evictions"] == 1
