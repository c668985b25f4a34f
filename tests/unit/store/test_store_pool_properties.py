"""BlockPool invariants under random operation sequences (hypothesis)."""

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from bus_schemas.control import TxAllocate, TxDone, TxRole
from bus_schemas.kv_events import BlockRemoved, BlockStored
from bus_schemas.requests import Retention
from services.common.clock import ManualClock
from services.store.pool.block_pool import Allocation, BlockPool
from tests.unit.store.test_store_block_pool import with_events

BLOCK = 2
CAPACITY = 12

# A request: (chain, full blocks, tail tokens, role, retention, lease); hashes of chain c
# are c*100 + i so requests of the same chain share prefixes.
request = st.tuples(
    st.integers(0, 3),
    st.integers(0, 6),
    st.integers(0, BLOCK - 1),
    st.sampled_from([TxRole.PREFILL, TxRole.PREFILL, TxRole.DECODE, TxRole.SOURCE]),
    st.sampled_from(
        [Retention.DEFAULT, Retention.DEFAULT, Retention.EPHEMERAL, Retention.CONTEXT_CACHE]
    ),
    st.sampled_from([1.0, 5.0, 30.0]),
)
op = st.one_of(
    st.tuples(st.just("alloc"), request),
    st.tuples(st.just("commit"), st.integers(0, 50)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("tick"), st.sampled_from([0.5, 2.0, 6.0])),
)


def check(
    pool: BlockPool, open_txs: dict[str, tuple[Allocation, list[int]]], pins: set[int]
) -> None:
    s = pool.stats()
    assert s["free_blocks"] + s["used_blocks"] == CAPACITY
    cached = {h: pool.slot_of(h) for h in pool._cached}
    tx_slots = [slot for a, _ in open_txs.values() for slot in a.slots[a.hit_blocks :]]
    every = list(pool._free) + list(cached.values()) + tx_slots
    assert sorted(every) == list(range(CAPACITY)), "a slot is lost or held twice"
    # reference counts balance: one per open transaction holding the block + one per pin
    want = Counter(h for a, hashes in open_txs.values() for h in hashes[: a.hit_blocks])
    for h in pool._pins:
        want[h] += 1
    assert dict(want) == pool._refs
    # locked blocks are cached and never evictable; everything else cached is evictable
    assert set(pool._refs) <= set(cached)
    assert set(pool.eviction_order()) == set(cached) - set(pool._refs)


@settings(max_examples=150, deadline=None)
@given(st.lists(op, min_size=1, max_size=40))
def test_random_operations_keep_the_books(ops):
    clock = ManualClock()
    pool = BlockPool(CAPACITY, BLOCK, clock, id_prefix="p-")
    open_txs: dict[str, tuple[Allocation, list[int]]] = {}
    for kind, arg in ops:
        if kind == "alloc":
            chain, full, tail, role, retention, lease = arg
            hashes = [chain * 100 + i for i in range(full)]
            locked_before = set(pool._refs)
            result, events = with_events(
                pool,
                pool.allocate(
                    TxAllocate(
                        request_id="r",
                        role=role,
                        block_hashes=hashes,
                        num_tokens=full * BLOCK + tail,
                        retention=retention,
                        context_ttl_s=3.0,
                        lease_s=lease,
                    )
                ),
            )
            for ev in events:
                assert isinstance(ev, BlockRemoved)
                assert not set(ev.block_hashes) & locked_before, "evicted a locked block"
                assert not set(ev.block_hashes) & set(hashes[: getattr(result, "hit_blocks", 0)])
            if isinstance(result, Allocation):
                open_txs[result.tx_id] = (result, hashes)
                n = len(hashes) if role == TxRole.SOURCE else -(-(full * BLOCK + tail) // BLOCK)
                assert len(result.slots) == n
        elif kind in ("commit", "abort"):
            if not open_txs:
                continue
            tx_id = sorted(open_txs)[arg % len(open_txs)]
            a, hashes = open_txs.pop(tx_id)
            done, events = with_events(
                pool, (pool.commit if kind == "commit" else pool.abort)(tx_id)
            )
            assert isinstance(done, TxDone)
            assert all(isinstance(e, BlockStored) for e in events)
            if kind == "abort":
                assert events == []
        else:
            clock.advance(arg)
            for tx_id in pool.expire():
                open_txs.pop(tx_id)
        check(pool, open_txs, set(pool._pins))
    # Everything released: nothing locked, all cached blocks evictable.
    for tx_id in list(open_txs):
        pool.abort(tx_id)
    clock.advance(100.0)
    assert pool.expire() == []
    assert pool._refs == {} and len(pool.eviction_order()) == pool.cached_blocks == pool.used_blocks
