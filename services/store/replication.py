"""Copies between stores, driven over NATS control subjects (the destination acts).

* ``Replicate`` on perigee.ctl.kv.replicate (paper §4.2 hot-spot replication): the
  store named ``dest_node`` opens a SOURCE tx on ``source_node`` (its blocks stay
  locked), allocates the blocks here, pulls them over the data plane, commits here
  (BlockStored) and releases the source. Blocks already here are skipped.
* ``ObjectReplicate`` on perigee.store.<dest>.obj.replicate: the destination reads the
  object from the source store's data plane (OBJ_GET) and stores it (as OBJ_PUT).
"""

from typing import TYPE_CHECKING

import structlog
from nats.aio.client import Client as NATS

from bus_schemas import subjects
from bus_schemas.control import (
    ObjectDone,
    ObjectReplicate,
    Refused,
    Replicate,
    TxAllocate,
    TxCommit,
    TxDone,
    TxDoneReply,
    TxHandle,
    TxReply,
    TxRole,
)
from services.common.bus import request
from services.store import wire
from services.store.channel import ChannelError, next_id
from services.store.client import TransferError, fetch_info
from services.store.core import StoreCore
from services.store.object_service import ObjectService

if TYPE_CHECKING:
    from services.store.transfer import DataPlane

log = structlog.get_logger()


class Replicator:
    def __init__(
        self, core: StoreCore, nc: NATS, objects: ObjectService, *, peer_timeout_s: float = 5.0
    ) -> None:
        self.core = core
        self.nc = nc
        self.objects = objects
        self.peer_timeout_s = peer_timeout_s
        self.data: DataPlane | None = None  # the store's data plane, once it started

    async def copy_blocks(self, req: Replicate) -> TxDone | Refused:
        core, pool = self.core, self.core.pool
        want = [h for h in req.block_hashes if not pool.is_cached(h)]
        if not want:
            return TxDone(tx_id="", stored_blocks=0)
        rid = f"replicate:{req.source_node}->{core.node}"
        src = await request(
            self.nc,
            subjects.store_ctl(req.source_node, "tx.allocate"),
            TxAllocate(
                request_id=rid, role=TxRole.SOURCE, block_hashes=want, num_tokens=0, lease_s=30.0
            ),
            TxReply,
            timeout=5.0,
        )
        if not isinstance(src, TxHandle):
            return src
        try:
            local = pool.allocate(
                TxAllocate(
                    request_id=rid,
                    role=TxRole.PREFILL,
                    block_hashes=want,
                    num_tokens=len(want) * core.block_size,
                    lease_s=30.0,
                )
            )
            if isinstance(local, Refused):
                return local
            assert self.data is not None
            pull = wire.Pull(
                id=next_id(),
                dst_tx=local.tx_id,
                dst_epoch=core.epoch,
                dst_slots=local.slots[local.hit_blocks :],
                src_addr=src.data_addr,
                src_tx=src.tx_id,
                src_epoch=src.epoch,
                src_slots=src.slots[local.hit_blocks :],
            )
            try:
                if pull.dst_slots:
                    await self.data.pull(pull)
            except (wire.WireError, ChannelError) as e:
                pool.abort(local.tx_id)
                return Refused(reason="transfer", message=str(e))
            return pool.commit(local.tx_id)
        finally:
            await request(
                self.nc,
                subjects.store_ctl(req.source_node, "tx.commit"),
                TxCommit(tx_id=src.tx_id, request_id=rid),
                TxDoneReply,
                timeout=5.0,
            )

    async def copy_object(self, req: ObjectReplicate) -> ObjectDone | Refused:
        node = self.core.node
        if req.dest_node != node:
            return Refused(reason="bad_request", message=f"this is {node}, not {req.dest_node}")
        size = self.objects.stat(req.key)
        if size is not None:
            return ObjectDone(key=req.key, node=node, size=size)
        try:
            info = await fetch_info(self.nc, req.source_node, timeout=2.0)
        except TransferError as e:
            return Refused(reason="unreachable", message=e.message)
        assert self.data is not None
        try:
            _, ok, data = await self.data.peers.request(
                info.data_addr, wire.ObjGet(id=next_id(), key=req.key), timeout=self.peer_timeout_s
            )
        except ChannelError as e:
            return Refused(
                reason="missing" if e.code == "missing" else "transfer", message=e.message
            )
        n = sum(len(d) for d in data)
        try:
            self.objects.put(wire.ObjPut(id=0, key=req.key, size=n), data)
        except wire.WireError as e:
            return Refused(reason=e.code, message=str(e))
        return ObjectDone(key=req.key, node=node, size=n)
