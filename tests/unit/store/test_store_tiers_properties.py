"""BlockPool invariants under random operations (hypothesis), with the bytes modelled.

Every slot of every tier holds a "content" (the hash written there). Moves are run in
order as the service would (in the pool's ``on_change`` hook); afterwards each block's
copies must hold that block's content, so a move that reads a slot after it was reused
is caught. The KV events the hook collects, applied in order, must always name exactly
the blocks on the node (what a conductor's prefix index relies on).
"""

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from bus_schemas.control import TxAllocate, TxDone, TxRole
from bus_schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from bus_schemas.requests import Retention
from services.common.clock import ManualClock
from services.store.pool.block_pool import Allocation, BlockPool
from services.store.pool.tier_policy import Tier

DRAM, SSD, VRAM = 6, 4, 2

request = st.tuples(
    st.integers(0, 3),
    st.integers(0, 4),
    st.integers(0, 1),
    st.sampled_from([TxRole.PREFILL, TxRole.PREFILL, TxRole.DECODE, TxRole.SOURCE]),
    st.sampled_from([Retention.DEFAULT, Retention.EPHEMERAL, Retention.CONTEXT_CACHE]),
)
op = st.one_of(
    st.tuples(st.just("alloc"), request),
    st.tuples(st.just("commit"), st.integers(0, 50)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("tick"), st.sampled_from([0.5, 4.0])),
    st.tuples(st.just("wb"), st.integers(1, 3)),
    st.tuples(st.just("wb_done"), st.booleans()),
    st.tuples(st.just("remove"), st.integers(0, 3)),
    st.tuples(st.just("clear"), st.none()),
)


class Model:
    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.data: dict[tuple[Tier, int], int] = {}
        self.open: dict[str, tuple[Allocation, list[int], TxRole]] = {}
        self.wb: list[int] = []
        self.batches: list[list] = []  # one per pool operation, from its on_change hook
        self.view: set[int] = set()  # the node's blocks as its KV events tell them
        pool.on_change = self.changed

    def changed(self) -> None:
        self.run_moves(self.pool.take_moves())
        events = self.pool.take_events()
        self.batches.append(events)
        for ev in events:
            if isinstance(ev, BlockStored):
                self.view.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                self.view.difference_update(ev.block_hashes)
            else:
                self.view.clear()

    def ran(self, result):
        """An operation's result and the events of its one on_change batch."""
        assert len(self.batches) == 1, "one on_change per operation"
        events = self.batches.pop()
        return (*result, events) if isinstance(result, tuple) else (result, events)

    def run_moves(self, moves) -> None:
        for m in moves:
            self.data[(m.dst, m.dst_slot)] = self.data.get((m.src, m.src_slot), -1)

    def check(self) -> None:
        p = self.pool
        self.batches.clear()
        assert self.view == p.node_blocks(), "KV events do not tell what the node holds"
        tx_slots = [s for a, _, _ in self.open.values() for s in a.slots[a.hit_blocks :]]
        assert sorted(list(p._free) + list(p._cached.values()) + tx_slots) == list(range(DRAM))
        want = Counter(h for a, hashes, _ in self.open.values() for h in hashes[: a.hit_blocks])
        for h in p._pins:
            if h in p._cached:
                want[h] += 1
        for h in self.wb:
            want[h] += 1
        assert dict(want) == p._refs, "reference counts do not balance"
        assert set(p.eviction_order()) == set(p._cached) - set(p._refs)
        for t in p.lower:
            assert sorted(list(t.free) + list(t.slots.values())) == list(range(t.capacity))
            lru = set(t.lru)
            assert not lru & t.pinned and not lru & set(t.held)
            assert lru | t.pinned | set(t.held) == set(t.slots)
        for h in p._pins:
            assert p.on_node(h), "a pinned block left the node"
        for h, s in p._cached.items():
            assert self.data.get((Tier.DRAM, s)) == h, f"DRAM copy of {h} is wrong"
        for t in p.lower:
            for h, s in t.slots.items():
                if h not in t.held or h not in self.wb:
                    assert self.data.get((t.tier, s)) == h, f"{t.tier.name} copy of {h} is wrong"
        for a, hashes, _ in self.open.values():
            for h, s in zip(hashes[: a.hit_blocks], a.slots, strict=False):
                assert p._cached.get(h) == s, "a block in use left DRAM"


@settings(max_examples=200, deadline=None)
@given(st.lists(op, min_size=1, max_size=50), st.booleans())
def test_random_operations_keep_the_books_across_tiers(ops, vram):
    clock = ManualClock()
    pool = BlockPool(
        DRAM, 2, clock, "p-", ssd_capacity=SSD, vram_capacity=VRAM if vram else 0, writeback=True
    )
    m = Model(pool)
    for kind, arg in ops:
        held_before = {h for a, hs, _ in m.open.values() for h in hs[: a.hit_blocks]} | set(
            pool._pins
        )
        events = []
        if kind == "alloc":
            chain, full, tail, role, retention = arg
            hashes = [chain * 100 + i for i in range(full)]
            result, events = m.ran(
                pool.allocate(
                    TxAllocate(
                        request_id="r",
                        role=role,
                        block_hashes=hashes,
                        num_tokens=full * 2 + tail,
                        retention=retention,
                        context_ttl_s=3.0,
                        lease_s=30.0,
                    )
                )
            )
            m.run_moves(pool.take_moves())
            if isinstance(result, Allocation):
                m.open[result.tx_id] = (result, hashes, role)
                for i, s in enumerate(result.slots[result.hit_blocks :], result.hit_blocks):
                    m.data[(Tier.DRAM, s)] = (
                        hashes[i] if i < len(hashes) else -2
                    )  # the worker writes
        elif kind in ("commit", "abort"):
            if not m.open:
                continue
            tx_id = sorted(m.open)[arg % len(m.open)]
            m.open.pop(tx_id)
            done, events = m.ran((pool.commit if kind == "commit" else pool.abort)(tx_id))
            assert isinstance(done, TxDone)
        elif kind == "tick":
            clock.advance(arg)
            pool.expire()
        elif kind == "wb":
            moves, events = m.ran(pool.writebacks(arg))
            m.run_moves(moves)
            m.wb.extend(mv.block_hash for mv in moves)
        elif kind == "wb_done":
            if m.wb:
                pool.writeback_done(m.wb.pop(0), arg)
        elif kind == "remove":
            _, busy, events = m.ran(pool.remove([arg * 100, arg * 100 + 1]))
            assert not set(busy) - held_before - set(m.wb)
        else:
            _, events = m.ran(pool.clear())
        for ev in events:
            if isinstance(ev, BlockRemoved):
                if kind not in ("remove", "clear"):
                    assert not set(ev.block_hashes) & held_before, (
                        "evicted a block in use or pinned"
                    )
                assert not any(pool.on_node(h) for h in ev.block_hashes)
            elif isinstance(ev, BlockStored):
                assert all(pool.on_node(h) for h in ev.block_hashes)
            else:
                assert isinstance(ev, AllBlocksCleared) and pool.cached_blocks == 0
        m.check()
    # release everything: nothing locked, every DRAM block evictable
    for h in list(m.wb):
        pool.writeback_done(h, True)
    m.wb.clear()
    for tx_id in list(m.open):
        pool.abort(tx_id)
    m.open.clear()
    clock.advance(100.0)
    pool.expire()
    assert pool._refs == {} and set(pool.eviction_order()) == set(pool._cached)
    m.check()
