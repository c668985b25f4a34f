"""Hot-spot migration (paper §4.2, Algorithm 1 lines 20-21), end to end over the pure
pieces: the placement policy, real store BlockPools driven the way the conductor's
transactions drive them, and the shadow PrefixIndex fed by the pools' KV events. The
instance that pulls a prefix ends up a replica of it, and the index says so."""

from bus_schemas.control import TxAllocate, TxDone, TxRole
from bus_schemas.kv_events import BlockStored, EventBatch
from bus_schemas.load import DecodeLoad, PrefillLoad
from services.common.clock import ManualClock
from services.common.cost_model import CostModel
from services.conductor.placement_policy import (
    Placement,
    PlacementPolicy,
    PlacementRequest,
    RemoteSource,
)
from services.conductor.prefix_index import PrefixIndex
from services.store.pool.block_pool import Allocation, BlockPool
from tests.unit.store.test_store_block_pool import with_events

BS = 32
N = 4 * BS + 10
HASHES = [11, 12, 13, 14]


class Node:
    def __init__(self, name: str, clock: ManualClock, index: PrefixIndex) -> None:
        self.name, self.index = name, index
        self.pool = BlockPool(16, BS, clock)
        self.seq = 0

    def emit(self, events) -> None:
        if events:
            self.seq += 1
            self.index.apply(
                EventBatch(node=self.name, epoch=1, seq=self.seq, ts=0.0, events=events)
            )

    def allocate(self, rid: str, role: TxRole, hashes, num_tokens: int) -> Allocation:
        res, events = with_events(
            self.pool,
            self.pool.allocate(
                TxAllocate(
                    request_id=rid, role=role, block_hashes=list(hashes), num_tokens=num_tokens
                )
            ),
        )
        self.emit(events)
        assert isinstance(res, Allocation), res
        return res

    def commit(self, tx: Allocation, rid: str) -> TxDone:
        res, events = with_events(self.pool, self.pool.commit(tx.tx_id, rid))
        self.emit(events)
        assert isinstance(res, TxDone), res
        return res


def test_the_pulling_instance_becomes_a_replica_of_the_hot_prefix():
    clock = ManualClock()
    index = PrefixIndex()
    n0, n1 = Node("n0", clock, index), Node("n1", clock, index)
    # A first request computed the prefix on n1 and committed it there.
    warm = n1.allocate("r0", TxRole.PREFILL, HASHES, N)
    assert n1.commit(warm, "r0").stored_blocks == 4
    assert index.match(HASHES) == {"n1": 4}

    pol = PlacementPolicy(clock, CostModel())
    pol.observe_prefill(
        PrefillLoad(
            instance="p0", node="n0", queue_len=0, queued_tokens=0, queued_work_s=0.0, ts=0.0
        )
    )
    pol.observe_prefill(
        PrefillLoad(
            instance="p1", node="n1", queue_len=9, queued_tokens=0, queued_work_s=10.0, ts=0.0
        )
    )
    pol.observe_decode(
        DecodeLoad(
            instance="d0",
            node="m0",
            batch_size=0,
            waiting=0,
            max_batch=8,
            kv_tokens=0,
            step_time_s=0.0,
            ts=0.0,
        )
    )

    def place(rid: str) -> Placement:
        d = pol.place(
            PlacementRequest(
                request_id=rid, num_tokens=N, block_hashes=tuple(HASHES), block_size=BS
            ),
            index.match(HASHES),
        )
        assert isinstance(d, Placement), d
        return d

    # The holder n1 is busy: p0 gets the request and pulls the whole prefix from n1.
    p = place("r1")
    assert p.prefill_instance == "p0" and p.remote == RemoteSource("n1", 0, 4)
    # The conductor's transactions: PREFILL on n0 allocates fresh slots for every block
    # (the pulled ones included), SOURCE on n1 locks the prefix it is read from.
    dst = n0.allocate("r1", TxRole.PREFILL, HASHES, N)
    src = n1.allocate("r1", TxRole.SOURCE, HASHES[:4], 4 * BS)
    assert dst.hit_blocks == 0 and len(dst.slots) == 5
    assert (
        n0.pool.check_write(dst.tx_id, dst.slots[:4]) is None
    )  # the pull lands in dst's own new slots
    assert n1.pool.check_read(src.tx_id, src.slots) is None
    assert all(n1.pool.lock_count(h) == 1 for h in HASHES)
    assert index.match(HASHES) == {"n1": 4}  # nothing announced before the commit

    # First token out: both committed (service: _on_event). n0 now holds the prefix.
    assert n0.commit(dst, "r1").stored_blocks == 4
    n1.commit(src, "r1")
    pol.prefill_done("r1", ts=0.0)
    assert index.match(HASHES) == {"n0": 4, "n1": 4}
    assert all(n1.pool.lock_count(h) == 0 and n0.pool.lock_count(h) == 0 for h in HASHES)
    assert n0.pool.stats()["cached_blocks"] == 4 and n0.pool.stats()["open_txs"] == 0

    # The next request for the hot prefix is served from the replica without a pull.
    again = place("r2")
    assert again.prefill_instance == "p0" and again.remote is None and again.prefix_blocks == 4
    assert n0.allocate("r2", TxRole.PREFILL, HASHES, N).hit_blocks == 4
    assert pol.stats["pulls"] == 1 and pol.stats["pulled_blocks"] == 4 and pol.stats["placed"] == 2


def test_partial_local_prefix_pulls_only_the_missing_blocks_and_stores_them():
    clock = ManualClock()
    index = PrefixIndex()
    n0, n1 = Node("n0", clock, index), Node("n1", clock, index)
    n1.commit(n1.allocate("w1", TxRole.PREFILL, HASHES, N), "w1")
    n0.commit(n0.allocate("w0", TxRole.PREFILL, HASHES[:1], BS), "w0")
    assert index.match(HASHES) == {"n0": 1, "n1": 4}
    pol = PlacementPolicy(clock, CostModel())
    pol.observe_prefill(
        PrefillLoad(
            instance="p0", node="n0", queue_len=0, queued_tokens=0, queued_work_s=0.0, ts=0.0
        )
    )
    pol.observe_prefill(
        PrefillLoad(
            instance="p1", node="n1", queue_len=9, queued_tokens=0, queued_work_s=10.0, ts=0.0
        )
    )
    pol.observe_decode(
        DecodeLoad(
            instance="d0",
            node="m0",
            batch_size=0,
            waiting=0,
            max_batch=8,
            kv_tokens=0,
            step_time_s=0.0,
            ts=0.0,
        )
    )
    p = pol.place(
        PlacementRequest(request_id="r", num_tokens=N, block_hashes=tuple(HASHES), block_size=BS),
        index.match(HASHES),
    )
    assert isinstance(p, Placement) and p.remote == RemoteSource("n1", 1, 3)  # 4/1 > 2
    dst = n0.allocate("r", TxRole.PREFILL, HASHES, N)
    assert dst.hit_blocks == 1  # block 0 is local and locked; blocks 1..3 come from n1
    assert n0.pool.check_write(dst.tx_id, dst.slots[1:4]) is None
    res, events = with_events(n0.pool, n0.pool.commit(dst.tx_id, "r"))
    assert events == [BlockStored(block_hashes=HASHES[1:])]
    n0.emit(events)
    assert index.match(HASHES) == {"n0": 4, "n1": 4}
