"""Pure pieces around objects, replay and the SSD store, by hand."""

import pytest

from bus_schemas.control import Refused
from bus_schemas.kv_events import BlockRemoved, BlockStored, EventBatch
from bus_schemas.requests import Retention
from services.common.clock import ManualClock
from services.store.__main__ import parse_args
from services.store.node.object_service import object_hashes
from services.store.node.tier_stores import MemoryStore, SsdStore, execute
from services.store.node.tiering import ReplayBuffer
from services.store.pool import replicas
from services.store.pool.block_pool import BlockPool
from services.store.pool.tier_policy import Move, Tier
from services.transfer.backends.contract import crc32
from tests.unit.store.test_store_block_pool import with_events


def test_rendezvous_rank_is_stable_and_replicas_are_distinct():
    nodes = ["a", "b", "c", "d"]
    order = replicas.rank("key", nodes)
    assert sorted(order) == nodes and replicas.rank("key", list(reversed(nodes))) == order
    assert (
        replicas.rank("key", [n for n in nodes if n != order[0]]) == order[1:]
    )  # minimal movement
    p = replicas.plan("key", nodes, holders={order[3]}, n=2)
    assert p.keep == order[:2]
    assert p.copies == [(order[3], order[0]), (order[3], order[1])] and p.removes == [order[3]]
    p = replicas.plan("key", nodes, holders=set(order[:3]), n=1)
    assert (p.copies, p.removes) == ([], order[1:3])
    assert replicas.plan("key", nodes, holders=set(), n=2).copies == []
    assert replicas.plan("key", nodes, holders={"a", "b"}, n=0).removes == [
        n for n in order if n in "ab"
    ]
    with pytest.raises(ValueError):
        replicas.plan("key", nodes, set(), -1)


def test_object_hashes_differ_by_version_and_index():
    a, b = object_hashes("k", 1, 3), object_hashes("k", 2, 3)
    assert len(set(a) | set(b)) == 6 and object_hashes("k", 1, 3) == a
    assert all(0 <= h < 1 << 63 for h in a)


def test_put_blocks_caches_at_once_and_dram_slots_touch_the_lru():
    pool = BlockPool(3, 1, ManualClock(), "t-")
    slots, events = with_events(pool, pool.put_blocks([5, 6]))
    assert (slots, events) == ([0, 1], [BlockStored(block_hashes=[5, 6])])
    assert pool.eviction_order() == [5, 6]
    assert pool.dram_slots([5]) == [0] and pool.eviction_order() == [6, 5]
    assert pool.dram_slots([5, 99]) is None
    slots, events = with_events(pool, pool.put_blocks([7, 8]))
    assert slots == [2, 1] and events == [
        BlockRemoved(block_hashes=[6]),
        BlockStored(block_hashes=[7, 8]),
    ]
    for bad in ([7], [9, 9]):
        refused, _ = with_events(pool, pool.put_blocks(bad))
        assert isinstance(refused, Refused) and refused.reason == "bad_request"
    refused, _ = with_events(pool, pool.put_blocks([1, 2, 3, 4]))
    assert isinstance(refused, Refused) and refused.reason == "capacity"
    refused, _ = with_events(pool, pool.put_blocks([10], Retention.EPHEMERAL))
    assert isinstance(refused, Refused)


def test_replay_buffer_says_when_a_gap_needs_a_dump():
    buf = ReplayBuffer(3)
    for seq in range(1, 6):
        buf.add(EventBatch(node="n", epoch=1, seq=seq, ts=0.0, events=[]))
    got, complete = buf.after(2, 10)
    assert [b.seq for b in got] == [3, 4, 5] and complete
    got, complete = buf.after(1, 10)
    assert [b.seq for b in got] == [3, 4, 5] and not complete  # batch 2 was dropped
    got, complete = buf.after(3, 1)
    assert [b.seq for b in got] == [4] and complete
    assert ReplayBuffer(2).after(0, 5) == ([], True)


def test_ssd_store_index_roundtrip_drops_blocks_whose_bytes_changed(tmp_path):
    ssd = SsdStore(str(tmp_path), capacity=4, block_bytes=8)
    ssd.write(0, memoryview(b"aaaaaaaa"))
    ssd.write(2, memoryview(b"cccccccc"))
    ssd.save_index([(100, 0, None), (300, 2, 1234.5), (400, 3, None)])  # slot 3 never written
    ssd.write(2, memoryview(b"CCCCCCCC"))  # overwritten after the index was saved
    ssd.close()
    again = SsdStore(str(tmp_path), capacity=4, block_bytes=8)
    assert again.load_index() == [(100, 0, None)]
    buf = memoryview(bytearray(8))
    again.read_into(0, buf)
    assert bytes(buf) == b"aaaaaaaa"
    again.close()
    other = SsdStore(str(tmp_path), capacity=4, block_bytes=16)  # a different block size
    assert other.load_index() == []
    other.close()
    (tmp_path / "index.msgpack").write_bytes(b"garbage")
    assert SsdStore(str(tmp_path), capacity=4, block_bytes=8).load_index() == []


def test_execute_runs_moves_in_order_through_a_staging_buffer():
    vram, ssd = MemoryStore(Tier.VRAM, 2, 4), MemoryStore(Tier.SSD, 2, 4)
    vram.write(0, memoryview(b"vvvv"))
    ssd.write(1, memoryview(b"ssss"))
    execute(
        [Move(1, Tier.SSD, 1, Tier.VRAM, 1), Move(2, Tier.VRAM, 0, Tier.SSD, 1)],
        {Tier.VRAM: vram, Tier.SSD: ssd},
        4,
    )
    assert bytes(vram.buf) == b"vvvvssss" and bytes(ssd.buf[4:]) == b"vvvv"


def test_cli_flags_for_tiers():
    a = parse_args(
        [
            "--node",
            "n",
            "--ssd-dir",
            "/tmp/x",
            "--ssd-capacity-blocks",
            "8",
            "--vram-capacity-blocks",
            "2",
            "--replay-batches",
            "16",
        ]
    )
    assert (a.ssd_dir, a.ssd_capacity_blocks, a.vram_capacity_blocks, a.replay_batches) == (
        "/tmp/x",
        8,
        2,
        16,
    )
    for bad in (
        ["--ssd-capacity-blocks", "8"],
        ["--replay-batches", "0"],
        ["--vram-capacity-blocks", "-1"],
    ):
        with pytest.raises(SystemExit):
            parse_args(["--node", "n", *bad])


def test_kv_events_leave_object_blocks_out():
    from services.store.node.object_service import ObjectService

    svc = ObjectService.__new__(ObjectService)
    svc.block_hashes = {1, 2}
    out = svc.kv_only(
        [
            BlockStored(block_hashes=[1, 2]),
            BlockStored(block_hashes=[3, 1]),
            BlockRemoved(block_hashes=[2, 4]),
        ]
    )
    assert out == [BlockStored(block_hashes=[3]), BlockRemoved(block_hashes=[4])]
    assert svc.block_hashes == {1}


def test_ssd_index_carries_the_objects_whose_blocks_it_holds(tmp_path):
    import msgspec

    ssd = SsdStore(str(tmp_path), capacity=4, block_bytes=8)
    for slot, b in ((0, b"aaaaaaaa"), (1, b"bbbbbbbb"), (2, b"cccccccc")):
        ssd.write(slot, memoryview(b))
    ssd.save_index(
        [(100, 0, None), (101, 1, None), (200, 2, None)],
        objects=[("k", 12, [100, 101]), ("half", 5, [200, 999])],
        object_blocks={100, 101, 200, 999},
    )
    ssd.close()
    again = SsdStore(str(tmp_path), capacity=4, block_bytes=8)
    state = again.load_state()
    assert state.entries == [(100, 0, None), (101, 1, None), (200, 2, None)]
    assert state.objects == [("k", 12, [100, 101])]  # "half" has a block the index lacks
    assert state.object_blocks == {100, 101, 200}
    # an index written before objects were persisted still loads (no objects)
    old = {
        "block_bytes": 8,
        "capacity": 4,
        "saved_at": 1.0,
        "entries": [[100, 0, crc32(b"aaaaaaaa"), None]],
    }
    (tmp_path / "index.msgpack").write_bytes(msgspec.msgpack.encode(old))
    state = again.load_state()
    assert (state.entries, state.objects, state.object_blocks) == ([(100, 0, None)], [], set())
    again.close()


def test_object_service_restores_whole_objects_and_names_the_orphan_blocks():
    from types import SimpleNamespace

    from services.store.node.object_service import ObjectService

    pool = BlockPool(4, 1, ManualClock(), "t-", ssd_capacity=8)
    svc = ObjectService(SimpleNamespace(epoch=5, block_bytes=8, pool=pool))  # type: ignore[arg-type]
    svc.expect({1, 2, 3, 4, 7})  # before the reload: its BlockStored is not KV
    assert svc.kv_only([BlockStored(block_hashes=[1, 9])]) == [BlockStored(block_hashes=[9])]
    loaded, events = with_events(
        pool, pool.restore([(h, i, None) for i, h in enumerate([1, 2, 3, 7])])
    )
    assert (loaded, events) == ([1, 2, 3, 7], [BlockStored(block_hashes=[1, 2, 3, 7])])
    orphans = svc.restore(
        [("whole", 16, [1, 2]), ("torn", 16, [3, 4]), ("bad size", 99, [7])],
        object_blocks={1, 2, 3, 4, 7},
    )
    assert {k: (m.size, m.hashes) for k, m in svc.table.items()} == {"whole": (16, [1, 2])}
    assert orphans == [3, 7]  # on the node, but their objects did not come back whole
    assert svc.block_hashes == {1, 2, 3, 7}  # 4 is not on the node: forgotten
    assert svc.persistable({1, 2, 3}) == [("whole", 16, [1, 2])] and svc.persistable({1}) == []
