"""A store stopped gracefully right after a commit still writes its blocks to the SSD
tier, so the next start finds them (in-process StoreService on a real nats-server)."""

import os
import tempfile

import nats

from bus_schemas import subjects
from bus_schemas.control import TxAllocate, TxCommit, TxDone, TxHandle, TxReply, TxRole
from services.common.bus import request
from services.store.node.server import StoreService

BS, BB = 4, 16 * 1024


def service(nc, ssd: str) -> StoreService:
    return StoreService(
        nc,
        node="flush-1",
        block_size=BS,
        block_bytes=BB,
        capacity_blocks=8,
        prefault=False,
        ssd_dir=ssd,
        ssd_capacity_blocks=16,
    )


async def test_stop_flushes_pending_writebacks_to_ssd(nats_url):
    nc = await nats.connect(nats_url)
    with tempfile.TemporaryDirectory() as tmp:
        ssd = os.path.join(tmp, "ssd")
        svc = service(nc, ssd)
        await svc.start()
        try:
            hashes = list(range(100, 106))
            h = await request(
                nc,
                subjects.store_ctl("flush-1", "tx.allocate"),
                TxAllocate(
                    request_id="r",
                    role=TxRole.PREFILL,
                    block_hashes=hashes,
                    num_tokens=len(hashes) * BS,
                ),
                TxReply,
                timeout=5,
            )
            assert isinstance(h, TxHandle)
            # The commit handler itself, then stop in the same step: the write-back task
            # has been woken but has not run yet.
            done = await svc._commit(TxCommit(tx_id=h.tx_id, request_id="r"), None)
            assert done == TxDone(tx_id=h.tx_id, stored_blocks=6)
            assert svc.pool.writeback_pending() == 6
        finally:
            await svc.stop()
        assert svc.pool.writeback_pending() == 0
        assert svc.pool.counters["writebacks"] == 6

        again = service(nc, ssd)
        await again.start()
        try:
            assert len(again.pool.ssd) == 6
        finally:
            await again.stop()
    await nc.close()
