"""The store's VRAM tier on a GPU: a real store process (``--vram-capacity-blocks``)
demotes DRAM's LRU victims into CUDA memory and promotes them back on a hit, byte for
byte. Without CUDA the same store starts without the tier and says why."""

import os
import tempfile

import nats
import pytest

from bus_schemas.control import TxDone, TxRole
from services.store.client.store_client import StoreClient
from tests.gpu.helpers import cuda_missing, on_gpu
from tests.unit.store.test_store_tiers_integration import (
    BB,
    alloc,
    commit,
    counters,
    start,
    stop,
)

pytestmark = pytest.mark.timeout(120)


async def fill(nc, client: StoreClient, node: str, hashes: list[int]) -> list[bytes]:
    h = await alloc(nc, node, hashes)
    blobs = [os.urandom(BB) for _ in hashes]
    for s, b in zip(h.slots, blobs, strict=True):
        client.slot(s)[:] = b
    assert await commit(nc, node, h) == TxDone(tx_id=h.tx_id, stored_blocks=len(hashes))
    return blobs


@on_gpu
async def test_dram_victims_go_to_vram_and_come_back(nats_url):
    with tempfile.TemporaryDirectory() as tmp:
        proc = start(nats_url, "g1", tmp, "--vram-capacity-blocks", "8")
        nc = await nats.connect(nats_url)
        try:
            client = await StoreClient.connect(nc, "g1", timeout=60)
            first = await fill(nc, client, "g1", [1, 2, 3, 4])  # DRAM holds 4
            await fill(nc, client, "g1", [5, 6, 7, 8])
            st = await counters(nc, "g1")
            assert (st["vram_capacity_blocks"], st["vram_blocks"], st["demoted"]) == (8, 4, 4)
            for b in range(4):  # the DRAM slots now hold the second four
                assert bytes(client.slot(b)) not in first
            src = await alloc(nc, "g1", [1, 2, 3, 4], role=TxRole.SOURCE, num_tokens=0)
            assert [bytes(client.slot(s)) for s in src.slots] == first  # promoted from VRAM
            assert isinstance(await commit(nc, "g1", src), TxDone)
            assert (await counters(nc, "g1"))["promoted"] == 4
            await client.close()
        finally:
            await nc.close()
            assert stop(proc) == 0


async def test_without_cuda_the_store_runs_without_the_tier(nats_url):
    if cuda_missing() is None:
        pytest.skip("CUDA is here: the tier opens (the test above)")
    with tempfile.TemporaryDirectory() as tmp:
        proc = start(nats_url, "g2", tmp, "--vram-capacity-blocks", "8")
        nc = await nats.connect(nats_url)
        try:
            client = await StoreClient.connect(nc, "g2", timeout=60)
            await fill(nc, client, "g2", [1, 2, 3, 4])
            await fill(nc, client, "g2", [5, 6, 7, 8])
            st = await counters(nc, "g2")
            assert "vram_capacity_blocks" not in st and st["demoted"] == 0
            await client.close()
        finally:
            await nc.close()
            assert stop(proc) == 0
        with open(os.path.join(tmp, "g2.log")) as f:
            assert "vram_tier_skipped" in f.read()
