"""Worker-side handle on its node's store: slots in shared memory, transfer requests over ZMQ.

Lifecycle::

    client = await StoreClient.connect(nc, node)   # waits for the store's "info",
                                                    # attaches the arena, connects to
                                                    # its Unix socket (else a DEALER)
    client.slot(i)                                  # read/write slot i in place
    await client.lease(src, dst, blocks)                 # optional: OPEN ahead of the ships
    await client.ship_layer(src, dst, layer, blocks, layer_bytes, layer_offset)
    await client.pull(dst, remote)
    await client.close()

Transfers are requests to the local store (no KV byte in them), which moves the bytes
store to store through its transfer engine; a request answers when the bytes are in
the far store's live slots (ship) or in place here (pull). They go over the store's
Unix socket (:mod:`services.transfer.local_channel`) when this process can reach it, else
over ZeroMQ to its data address.
Every failure (dead peer, timeout, stale transaction, bad slots) raises
:class:`TransferError` with a stable ``code``.
"""

import asyncio
from typing import Any

import nats.errors
import structlog
import zmq.asyncio
from nats.aio.client import Client as NATS

from bus_schemas import subjects
from bus_schemas.codec import BadMessage, decode
from bus_schemas.control import StoreInfo, TxHandle
from bus_schemas.placement import RemotePrefix
from services.common.errors import CodedError
from services.store.arena import Arena, ArenaError
from services.transfer import wire
from services.transfer.channel import Channel, ChannelError, next_id
from services.transfer.local_channel import LocalChannel
from tracing import inject

log = structlog.get_logger()

# A transfer may take this long plus its size at a floor of 50 MB/s; the store's own
# peer deadline is shorter, so a dead peer surfaces as the store's error reply.
DEFAULT_OP_TIMEOUT_S = 10.0
SECONDS_PER_BYTE = 1 / 50e6


class TransferError(CodedError, RuntimeError):
    """A ship or pull that did not complete. ``code``: timeout, closed, epoch, forbidden,
    bad_request, peer_<code>, wrong_node, ..."""


class StoreClient:
    """A worker's handle on its node's store: the arena's slots and ship/pull requests."""

    def __init__(
        self,
        nc: NATS,
        info: StoreInfo,
        arena: Arena,
        channel: Channel | LocalChannel,
        op_timeout_s: float,
        ctx: zmq.asyncio.Context | None = None,
    ) -> None:
        self.nc = nc
        self._info = info
        self.arena = arena
        self._channel = channel
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self.op_timeout_s = op_timeout_s
        self._reattaching = asyncio.Lock()
        self._populating: asyncio.Future | None = None  # a new arena's pages, mapped in turns

    @classmethod
    async def connect(
        cls,
        nc: NATS,
        node: str,
        *,
        timeout: float = 10.0,
        op_timeout_s: float = DEFAULT_OP_TIMEOUT_S,
        ctx: zmq.asyncio.Context | None = None,
    ) -> "StoreClient":
        """Wait (up to ``timeout``) for ``node``'s store to answer ``info``, then attach."""
        info = await fetch_info(nc, node, timeout)
        arena = Arena.attach(info.shm_name, info.capacity_blocks, info.block_bytes)
        await arena.populate()  # before the first request, the loop turning meanwhile
        ctx = ctx or zmq.asyncio.Context.instance()
        return cls(nc, info, arena, await _channel_to(info, ctx), op_timeout_s, ctx)

    @property
    def local(self) -> bool:
        """Whether requests take the store's Unix socket (not ZeroMQ)."""
        return isinstance(self._channel, LocalChannel)

    @property
    def info(self) -> StoreInfo:
        return self._info

    def slot(self, i: int) -> memoryview:
        """Writable view of slot ``i`` of this node's arena (call :meth:`attached` with
        the transaction first: its slots are in the arena of the epoch it came from)."""
        return self.arena.slot(i)

    async def attached(self, tx: TxHandle) -> None:
        """Attach to ``tx``'s incarnation of the store (a restart since the last one gave
        it a new arena); raises TransferError ``epoch`` for a dead incarnation's tx."""
        await self._check_local(tx)

    async def ship_layer(
        self,
        src: TxHandle,
        dst: TxHandle,
        layer: int,
        blocks: list[int],
        layer_bytes: int,
        layer_offset: int,
        commit_src: str = "",
    ) -> None:
        """Send bytes ``[layer_offset, layer_offset + layer_bytes)`` of ``src.slots[b]``
        (this node) into the same span of ``dst.slots[b]`` on ``dst.node``'s store, for
        each block index ``b`` in ``blocks``; returns once that store acked.

        Ships of the same blocks share one write grant on the far store; the span that
        reaches the end of the slot (the last layer: slots are layer-major) ends it, and
        its return says the far store accepted every byte shipped under the grant.
        ``commit_src`` (the request's id): this is the last read of ``src``, which the
        store commits once the ship is acked (a refusal is the store's to log)."""
        await self._check_local(src)
        if dst.block_bytes != self._info.block_bytes:
            raise TransferError(
                "bad_request",
                f"block size differs: {dst.node} has "
                f"{dst.block_bytes} bytes, {self._info.node} {self._info.block_bytes}",
            )
        if not blocks:
            return
        src_slots = _pick(src, blocks, "src")
        dst_slots = _pick(dst, blocks, "dst")
        header = wire.Ship(
            id=next_id(),
            src_tx=src.tx_id,
            src_epoch=src.epoch,
            src_slots=src_slots,
            dst_addr=dst.data_addr,
            dst_tx=dst.tx_id,
            dst_epoch=dst.epoch,
            dst_slots=dst_slots,
            offset=layer_offset,
            length=layer_bytes,
            layer=layer,
            trace=inject(),
            last=layer_offset + layer_bytes >= self._info.block_bytes,
            commit_src=commit_src,
        )
        await self._request(header, len(blocks) * layer_bytes)

    async def lease(self, src: TxHandle, dst: TxHandle, blocks: list[int]) -> None:
        """Have the store open, ahead of the ships, the grant that :meth:`ship_layer` of
        ``blocks`` into ``dst`` will use (a prefill worker calls it as the compute starts,
        so that round trip overlaps the compute); returns once granted. Optional: the
        first ship opens the grant itself."""
        await self._check_local(src)
        if not blocks:
            return
        header = wire.Lease(
            id=next_id(),
            dst_addr=dst.data_addr,
            dst_tx=dst.tx_id,
            dst_epoch=dst.epoch,
            dst_slots=_pick(dst, blocks, "dst"),
            trace=inject(),
        )
        await self._request(header, 0)

    async def pull(self, dst: TxHandle, remote: RemotePrefix) -> None:
        """Copy request blocks ``remote.first_block .. + remote.num_blocks`` from the
        SOURCE transaction on ``remote.source_node`` into ``dst.slots[...]`` (this node).

        ``remote.source_tx.slots`` is indexed by the request's block index when it covers
        them (the SOURCE tx locked the whole prefix), or holds exactly the pulled blocks.
        """
        await self._check_local(dst)
        src = remote.source_tx
        if src.block_bytes != self._info.block_bytes:
            raise TransferError(
                "bad_request",
                f"block size differs: {src.node} has "
                f"{src.block_bytes} bytes, {self._info.node} {self._info.block_bytes}",
            )
        first, n = remote.first_block, remote.num_blocks
        if n <= 0:
            return
        if first < 0:
            raise TransferError("bad_request", f"first_block {first} < 0")
        blocks = list(range(first, first + n))
        if len(src.slots) >= first + n:
            src_slots = [src.slots[b] for b in blocks]
        elif len(src.slots) == n:
            src_slots = list(src.slots)
        else:
            raise TransferError(
                "bad_request",
                f"source tx {src.tx_id} has {len(src.slots)} "
                f"slots, cannot hold blocks {first}..{first + n - 1}",
            )
        dst_slots = _pick(dst, blocks, "dst")
        header = wire.Pull(
            id=next_id(),
            dst_tx=dst.tx_id,
            dst_epoch=dst.epoch,
            dst_slots=dst_slots,
            src_addr=src.data_addr,
            src_tx=src.tx_id,
            src_epoch=src.epoch,
            src_slots=src_slots,
            trace=inject(),
        )
        await self._request(header, n * self._info.block_bytes)

    async def refresh(self, timeout: float = 2.0) -> StoreInfo:
        """Ask the store for its current info (used blocks, seq); follows a restart."""
        info = await fetch_info(self.nc, self._info.node, timeout)
        if info.epoch != self._info.epoch:
            await self._reattach()
        else:
            self._info = info
        return self._info

    async def _reattach(self, want_epoch: int | None = None) -> None:
        """Follow a restarted store: new arena, new data address."""
        async with self._reattaching:
            if want_epoch is not None and self._info.epoch >= want_epoch:
                return  # another request already followed the restart
            info = await fetch_info(self.nc, self._info.node, timeout=2.0)
            if info.epoch == self._info.epoch:
                return
            try:
                arena = Arena.attach(info.shm_name, info.capacity_blocks, info.block_bytes)
            except ArenaError as e:
                raise TransferError("store_restarted", str(e)) from None
            # Mapped while in use: all at once held this worker's event loop 0.5-3 s.
            self._populating = asyncio.ensure_future(arena.populate())
            self.arena.close()
            self.arena, self._info = arena, info
            self._channel.close()
            self._channel = await _channel_to(info, self._ctx)

    async def close(self) -> None:
        if self._populating is not None:
            self._populating.cancel()
        await self._channel.aclose()
        self.arena.close()

    # ---------------------------------------------------------------- internals

    async def _check_local(self, tx: TxHandle) -> None:
        if tx.node != self._info.node:
            raise TransferError(
                "wrong_node",
                f"{tx.tx_id} is on {tx.node}, this client is attached to {self._info.node}",
            )
        if tx.epoch > self._info.epoch:  # the store restarted since we attached
            await self._reattach(tx.epoch)
        if tx.epoch != self._info.epoch:
            raise TransferError(
                "epoch",
                f"{tx.tx_id} is from epoch {tx.epoch}, the store on "
                f"{tx.node} is at {self._info.epoch} (restarted?)",
            )

    async def _request(self, header: Any, nbytes: int) -> None:
        if self._channel.closed:  # a timeout closed it: reconnect for the next request
            self._channel = await _channel_to(self._info, self._ctx)
        timeout = self.op_timeout_s + nbytes * SECONDS_PER_BYTE
        try:
            await self._channel.request(header, timeout=timeout)
        except ChannelError as e:
            raise TransferError(e.code, e.message) from None


async def _channel_to(info: StoreInfo, ctx: zmq.asyncio.Context) -> Channel | LocalChannel:
    """The store's Unix socket when this process reaches it, else its ZeroMQ address."""
    if info.ctl_path:
        try:
            return await LocalChannel.connect(info.ctl_path)
        except OSError as e:
            log.info("store_socket_unreachable", node=info.node, path=info.ctl_path, error=str(e))
    return Channel(ctx, info.data_addr)


def _pick(tx: TxHandle, blocks: list[int], side: str) -> list[int]:
    try:
        if any(b < 0 for b in blocks):
            raise IndexError
        return [tx.slots[b] for b in blocks]
    except IndexError:
        raise TransferError(
            "bad_request",
            f"{side} tx {tx.tx_id} has {len(tx.slots)} slots, blocks {blocks[:8]} out of range",
        ) from None


async def fetch_info(nc: NATS, node: str, timeout: float = 10.0) -> StoreInfo:
    """``node``'s StoreInfo, retrying until the store answers or ``timeout`` passes."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    subject = subjects.store_ctl(node, "info")
    last = "no reply"
    while True:
        left = deadline - loop.time()
        if left <= 0:
            raise TransferError(
                "timeout", f"store {node} did not answer info in {timeout}s ({last})"
            )
        try:
            msg = await nc.request(subject, b"", timeout=min(0.5, left))
            return decode(msg.data, StoreInfo)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as e:
            last = type(e).__name__
            if isinstance(e, nats.errors.NoRespondersError):
                await asyncio.sleep(min(0.05, max(0.0, deadline - loop.time())))
        except BadMessage as e:
            raise TransferError("bad_reply", str(e)) from None
