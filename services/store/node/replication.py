"""Copies between stores, driven over NATS control subjects (the destination acts).

* ``Replicate`` on perigee.ctl.kv.replicate (paper §4.2 hot-spot replication): the
  store named ``dest_node`` opens a SOURCE tx on ``source_node`` (its blocks stay
  locked), allocates the blocks here, pulls them over the data plane, commits here
  (BlockStored) and releases the source. Blocks already here are skipped.
* ``ObjectReplicate`` on perigee.store.<dest>.obj.replicate: the destination asks the
  source for the object's blocks (obj.stat), opens a SOURCE tx over them there,
  reserves fresh object blocks here and pulls the bytes the same way, then adopts them.

Bytes move only through the data plane's transfer engine; ZeroMQ and NATS carry
which transaction, which slots, done or failed.
"""

from typing import TYPE_CHECKING

import structlog
from nats.aio.client import Client as NATS

from bus_schemas import subjects
from bus_schemas.control import (
    ObjectDone,
    ObjectKey,
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
from services.store.node.object_service import ObjectService
from services.store.node.store_core import StoreCore
from services.store.pool.block_pool import Allocation
from services.transfer import wire
from services.transfer.channel import ChannelError, next_id

if TYPE_CHECKING:
    from services.store.node.data_plane import DataPlane

log = structlog.get_logger()


class Replicator:
    """Copies blocks and objects from another store into this one when asked over NATS."""

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
        src = await self._lock_source(req.source_node, want, rid)
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
            failed = await self._pull(src, local, local.hit_blocks)
            if failed is not None:
                pool.abort(local.tx_id)
                return failed
            return pool.commit(local.tx_id)
        finally:
            await self._release(req.source_node, src.tx_id, rid)

    async def _lock_source(self, node: str, hashes: list[int], rid: str) -> TxHandle | Refused:
        """A SOURCE tx over ``hashes`` on ``node``: its blocks stay put while we pull."""
        try:
            reply: TxHandle | Refused = await request(
                self.nc,
                subjects.store_ctl(node, "tx.allocate"),
                TxAllocate(
                    request_id=rid,
                    role=TxRole.SOURCE,
                    block_hashes=hashes,
                    num_tokens=0,
                    lease_s=30.0,
                ),
                TxReply,
                timeout=self.peer_timeout_s,
            )
        except Exception as e:  # noqa: BLE001 - timeouts, no responders, error replies
            return Refused(reason="unreachable", message=f"{node}: {e!r}")
        return reply

    async def _pull(self, src: TxHandle, local: Allocation, skip: int) -> Refused | None:
        """Bring ``src``'s slots (past the first ``skip``) into ``local``'s through the
        data plane's transfer engine (ZeroMQ only coordinates); None once they landed."""
        assert self.data is not None
        pull = wire.Pull(
            id=next_id(),
            dst_tx=local.tx_id,
            dst_epoch=self.core.epoch,
            dst_slots=local.slots[skip:],
            src_addr=src.data_addr,
            src_tx=src.tx_id,
            src_epoch=src.epoch,
            src_slots=src.slots[skip:],
        )
        try:
            if pull.dst_slots:
                await self.data.pull(pull)
        except (wire.WireError, ChannelError) as e:
            return Refused(reason="transfer", message=str(e))
        return None

    async def _release(self, node: str, tx_id: str, rid: str) -> None:
        try:
            await request(
                self.nc,
                subjects.store_ctl(node, "tx.commit"),
                TxCommit(tx_id=tx_id, request_id=rid),
                TxDoneReply,
                timeout=5.0,
            )
        except Exception as e:  # noqa: BLE001 - its lease frees the source's blocks then
            log.warning("source_release_failed", node=node, tx_id=tx_id, error=repr(e))

    async def copy_object(self, req: ObjectReplicate) -> ObjectDone | Refused:
        """The object's blocks pulled from a SOURCE tx on ``source_node`` into fresh
        blocks here, through the transfer engine like any KV copy."""
        node = self.core.node
        if req.dest_node != node:
            return Refused(reason="bad_request", message=f"this is {node}, not {req.dest_node}")
        size = self.objects.stat(req.key)
        if size is not None:
            return ObjectDone(key=req.key, node=node, size=size)
        try:
            there = await request(
                self.nc,
                subjects.store_ctl(req.source_node, "obj.stat"),
                ObjectKey(key=req.key),
                ObjectDone,
                timeout=self.peer_timeout_s,
            )
        except Exception as e:  # noqa: BLE001 - timeouts, no responders, error replies
            return Refused(reason="unreachable", message=f"{req.source_node}: {e!r}")
        if not there.present or not there.block_hashes:
            return Refused(reason="missing", message=f"{req.key!r} is not on {req.source_node}")
        rid = f"obj-replicate:{req.source_node}->{node}"
        src = await self._lock_source(req.source_node, there.block_hashes, rid)
        if not isinstance(src, TxHandle):
            if src.reason == "unreachable":
                return src
            # Replaced or evicted since the stat: the version asked for is gone.
            return Refused(reason="missing", message=f"{req.key!r} on {req.source_node}: {src}")
        try:
            local, hashes = self.objects.reserve(req.key, there.size)
            if isinstance(local, Refused):
                return local
            failed = await self._pull(src, local, 0)
            if failed is not None:
                self.objects.cancel(hashes, local.tx_id)
                return failed
            kept = self.objects.adopt(req.key, there.size, hashes, local.tx_id)
        finally:
            await self._release(req.source_node, src.tx_id, rid)
        if isinstance(kept, Refused):
            return kept
        return ObjectDone(key=req.key, node=node, size=kept)
