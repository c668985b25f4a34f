"""services.common.prefault: a segment's pages mapped in chunks, the event loop turning
between them; and a store that serves while its arena is being mapped."""

import asyncio
import mmap

import nats
import pytest

from bus_schemas import subjects
from bus_schemas.control import StoreInfo
from services.common import prefault
from services.common.bus import request
from services.store.arena import Arena
from services.store.node.server import StoreService

MiB = 1 << 20


def shared(size: int) -> mmap.mmap:
    return mmap.mmap(-1, size, flags=mmap.MAP_SHARED)


pytestmark = pytest.mark.skipif(
    not prefault.supported(shared(mmap.PAGESIZE)), reason="no MADV_POPULATE_WRITE here"
)


async def test_the_loop_turns_between_chunks():
    mm = shared(64 * MiB)
    turns = 0
    done = asyncio.Event()

    async def ticker() -> None:
        nonlocal turns
        while not done.is_set():
            turns += 1
            await asyncio.sleep(0)

    t = asyncio.create_task(ticker())
    assert await prefault.populate_async(mm, chunk=4 * MiB)
    done.set()
    await t
    assert turns >= 15  # 16 chunks: a turn of the loop after each (one go: 1)
    assert list(prefault.chunks(mm, chunk=24 * MiB)) == [24 * MiB, 48 * MiB, 64 * MiB]


async def test_a_map_closed_meanwhile_stops_it_without_raising():
    mm = shared(8 * MiB)
    run = asyncio.create_task(prefault.populate_async(mm, chunk=MiB))
    await asyncio.sleep(0)  # the first chunk is done
    mm.close()
    assert await run is False
    a = Arena.create(4, MiB)
    a.close()
    assert await a.populate() is False and not a.populates()
    a.unlink()


async def test_a_store_serves_while_its_arena_is_mapped(nats_url, monkeypatch):
    """The store answers before its pages are mapped: all at once, a 2 GB arena kept a
    restarted store silent 1.2-6 s. The one-go prefault is not called where the kernel
    populates on advice, and the pages are mapped in the background."""

    def at_once(self) -> None:
        raise AssertionError("the arena was mapped before the store served")

    monkeypatch.setattr(Arena, "prefault", at_once)
    nc = await nats.connect(nats_url)
    svc = StoreService(
        nc, node="pf-1", block_size=4, block_bytes=MiB, capacity_blocks=64, prefault=True
    )
    await svc.start()
    try:
        info = await request(nc, subjects.store_ctl("pf-1", "info"), b"", StoreInfo)
        assert info.node == "pf-1" and info.capacity_blocks == 64
        populating = [t for t in svc._tasks if t.get_name() == "store:prefault"]
        assert len(populating) == 1
        await populating[0]  # the background mapping finishes, and nothing failed
        assert not svc.failed.is_set()
    finally:
        await svc.stop()
        await nc.close()
