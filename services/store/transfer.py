"""The store's data plane: one ROUTER socket that serves local workers and peer stores.

Lifecycle of a request on the ROUTER (see :mod:`services.store.wire` for frames):

    received -> parsed (bad frame: ERR reply, loop goes on)
      WRITE / READ (from a peer store): checked against the block pool (the slots must
          belong to a live transaction of this epoch; WRITE only into slots the
          transaction allocated) and copied in place; answered at once.
      SHIP / PULL (from a local worker): run as their own task — the local slots are
          checked, the peer is asked through a pooled DEALER (:class:`PeerPool`), and the
          worker is answered OK or ERR when the peer answered or the deadline passed.
          A ship or pull whose other end is this very store is a local memcpy.

Payload bytes are never touched in Python: spans of the arena are sent as zero-copy
frames and received frames are copied into the arena with one memcpy per piece.
"""

import asyncio
from collections.abc import Callable
from typing import Any

import structlog
import zmq
import zmq.asyncio
from opentelemetry import trace

from services.store import wire
from services.store.arena import Arena
from services.store.block_pool import BlockPool
from services.store.channel import ChannelError, PeerPool, next_id, tune
from tracing import extract, inject, tracer

log = structlog.get_logger()

# Below this many bytes per span, spans are packed into one buffer before sending:
# one memcpy is cheaper than per-frame overhead for small frames.
PACK_BELOW = 64 * 1024
# Large transfers go as several requests of about this size, in flight together, so
# the sender's copy, the kernel and the receiver's copy overlap (and memory stays bounded).
CHUNK_BYTES = 4 << 20
# Transfers get ``peer_timeout_s`` plus this much time per byte (a floor of 50 MB/s).
SECONDS_PER_BYTE = 1 / 50e6


class DataPlane:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        pool: BlockPool,
        arena: Arena,
        epoch: int,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        peer_timeout_s: float = 5.0,
        max_peers: int = 64,
    ) -> None:
        self.pool = pool
        self.arena = arena
        self.epoch = epoch
        self.peer_timeout_s = peer_timeout_s
        self.peers = PeerPool(ctx, max_peers=max_peers)
        self.sock = ctx.socket(zmq.ROUTER)
        tune(self.sock)
        if port:
            self.sock.bind(f"tcp://{host}:{port}")
        else:
            port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.data_addr = f"tcp://{advertise_host or host}:{port}"
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "ships", "pulls", "writes_in", "reads_in", "blocks_written_remote",
                "blocks_read_remote", "bytes_in", "bytes_out", "local_copies",
                "transfer_errors", "bad_frames",
            ),
            0,
        )
        self._tasks: set[asyncio.Task] = set()
        self.objects: Any = None  # ObjectService: serves OBJ_PUT / OBJ_GET when set

    # ---------------------------------------------------------------- loop

    async def run(self) -> None:
        """Serve the ROUTER until cancelled."""
        while True:
            parts = await self.sock.recv_multipart(copy=False)
            if len(parts) < 2:
                continue
            ident, rest = parts[0].bytes, parts[1:]
            header: Any = None
            try:
                kind, header, payload = wire.parse(rest)
                if kind in (wire.Kind.WRITE, wire.Kind.READ):
                    with tracer().start_as_current_span(
                        f"store.{kind.name.lower()}", context=extract(header.trace),
                        kind=trace.SpanKind.SERVER,
                    ):
                        if kind == wire.Kind.WRITE:
                            out = self._write(header, payload)
                        else:
                            out = self._read(header)
                    await self._reply(ident, *out)
                elif kind in (wire.Kind.OBJ_PUT, wire.Kind.OBJ_GET) and self.objects is not None:
                    if kind == wire.Kind.OBJ_PUT:
                        out = self.objects.put(header, payload)
                    else:
                        out = self.objects.get(header)
                    await self._reply(ident, *out)
                elif kind in (wire.Kind.SHIP, wire.Kind.PULL):
                    op = self._ship if kind == wire.Kind.SHIP else self._pull
                    task = asyncio.get_running_loop().create_task(self._serve_op(ident, op, header))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                else:
                    raise wire.WireError(f"{kind.name} is a reply, not a request", req_id=header.id)
            except wire.WireError as e:
                self.counters["bad_frames" if e.code == "bad_frame" else "transfer_errors"] += 1
                log.warning("data_plane_refused", code=e.code, error=str(e))
                await self._reply(ident, wire.Err(id=e.req_id, code=e.code, message=str(e)))
            except Exception as e:  # noqa: BLE001 - a bug in one request must not stop the loop
                log.exception("data_plane_request_failed")
                rid = getattr(header, "id", -1)
                msg = f"{type(e).__name__}: {e}"
                await self._reply(ident, wire.Err(id=rid, code="internal", message=msg))

    async def _reply(self, ident: bytes, header: Any, payload: list[Any] | None = None) -> None:
        out = [ident, *wire.frames(header, payload or ())]
        await self.sock.send_multipart(out, copy=not wire.zero_copy(out))

    async def _serve_op(self, ident: bytes, op: Callable, header: Any) -> None:
        name = "store.ship" if isinstance(header, wire.Ship) else "store.pull"
        try:
            with tracer().start_as_current_span(
                name, context=extract(header.trace), kind=trace.SpanKind.SERVER
            ) as span:
                span.set_attribute("blocks", len(header.dst_slots))
                reply = await op(header)
        except wire.WireError as e:
            self.counters["transfer_errors"] += 1
            reply = wire.Err(id=header.id, code=e.code, message=str(e))
        except ChannelError as e:
            self.counters["transfer_errors"] += 1
            code = e.code if e.code in ("timeout", "closed") else f"peer_{e.code}"
            reply = wire.Err(id=header.id, code=code, message=e.message)
        except Exception as e:  # noqa: BLE001 - one bad op must not stop the data plane
            log.exception("data_plane_op_failed")
            reply = wire.Err(id=header.id, code="internal", message=f"{type(e).__name__}: {e}")
        if isinstance(reply, wire.Err):
            log.warning("transfer_failed", code=reply.code, error=reply.message)
        try:
            await self._reply(ident, reply)
        except zmq.ZMQError:
            pass

    # ---------------------------------------------------------------- checks

    def _spans(self, slots: list[int], offset: int, length: int, req_id: int) -> list[memoryview]:
        try:
            return self.arena.spans(slots, offset, length)
        except IndexError as e:
            raise wire.WireError(str(e), code="bad_request", req_id=req_id) from None

    def _check(self, tx: str, epoch: int, slots: list[int], write: bool, req_id: int) -> None:
        if epoch != self.epoch:
            raise wire.WireError(
                f"transaction {tx} is from epoch {epoch}, this store is at {self.epoch}",
                code="epoch", req_id=req_id,
            )
        why = (self.pool.check_write if write else self.pool.check_read)(tx, slots)
        if why is not None:
            raise wire.WireError(why, code="forbidden", req_id=req_id)

    # ---------------------------------------------------------------- store -> store

    def _write(self, h: wire.Write, payload: list[memoryview]) -> tuple[Any, list[Any]]:
        self._check(h.tx, h.epoch, h.slots, True, h.id)
        n = wire.scatter(payload, self._spans(h.slots, h.offset, h.length, h.id))
        self.counters["writes_in"] += 1
        self.counters["blocks_written_remote"] += len(h.slots)
        self.counters["bytes_in"] += n
        return wire.Ok(id=h.id, nbytes=n), []

    def _read(self, h: wire.Read) -> tuple[Any, list[Any]]:
        self._check(h.tx, h.epoch, h.slots, False, h.id)
        spans = _pack(self._spans(h.slots, h.offset, h.length, h.id))
        n = sum(len(s) for s in spans)
        self.counters["reads_in"] += 1
        self.counters["blocks_read_remote"] += len(h.slots)
        self.counters["bytes_out"] += n
        return wire.Ok(id=h.id, nbytes=n), spans

    # ---------------------------------------------------------------- worker -> store

    def _deadline(self, nbytes: int) -> float:
        return self.peer_timeout_s + nbytes * SECONDS_PER_BYTE

    async def _ship(self, h: wire.Ship) -> wire.Ok:
        if len(h.src_slots) != len(h.dst_slots):
            raise wire.WireError("src_slots and dst_slots differ in length", "bad_request", h.id)
        self._check(h.src_tx, h.src_epoch, h.src_slots, False, h.id)
        spans = self._spans(h.src_slots, h.offset, h.length, h.id)
        self.counters["ships"] += 1
        if h.dst_addr == self.data_addr:
            self._check(h.dst_tx, h.dst_epoch, h.dst_slots, True, h.id)
            n = wire.scatter(spans, self._spans(h.dst_slots, h.offset, h.length, h.id))
            self.counters["local_copies"] += 1
            return wire.Ok(id=h.id, nbytes=n)
        nbytes = len(h.src_slots) * h.length
        per = max(1, CHUNK_BYTES // max(1, h.length))

        async def chunk(i: int) -> None:
            req = wire.Write(id=next_id(), tx=h.dst_tx, epoch=h.dst_epoch,
                             slots=h.dst_slots[i : i + per], offset=h.offset, length=h.length,
                             trace=inject())
            payload = _pack(self._spans(h.src_slots[i : i + per], h.offset, h.length, h.id))
            timeout = self._deadline(nbytes)
            await self.peers.request(h.dst_addr, req, payload, timeout=timeout)

        await asyncio.gather(*(chunk(i) for i in range(0, len(h.src_slots), per)))
        self.counters["bytes_out"] += nbytes
        return wire.Ok(id=h.id, nbytes=nbytes)

    async def _pull(self, h: wire.Pull) -> wire.Ok:
        if len(h.src_slots) != len(h.dst_slots):
            raise wire.WireError("src_slots and dst_slots differ in length", "bad_request", h.id)
        bb = self.arena.block_bytes
        self._check(h.dst_tx, h.dst_epoch, h.dst_slots, True, h.id)
        self._spans(h.dst_slots, 0, bb, h.id)
        self.counters["pulls"] += 1
        if h.src_addr == self.data_addr:
            self._check(h.src_tx, h.src_epoch, h.src_slots, False, h.id)
            src = self._spans(h.src_slots, 0, bb, h.id)
            n = wire.scatter(src, self._spans(h.dst_slots, 0, bb, h.id))
            self.counters["local_copies"] += 1
            return wire.Ok(id=h.id, nbytes=n)
        nbytes = len(h.src_slots) * bb
        per = max(1, CHUNK_BYTES // bb)

        async def chunk(i: int) -> int:
            req = wire.Read(id=next_id(), tx=h.src_tx, epoch=h.src_epoch,
                            slots=h.src_slots[i : i + per], offset=0, length=bb, trace=inject())
            _, _, data = await self.peers.request(h.src_addr, req, timeout=self._deadline(nbytes))
            # The transaction may have been aborted while the bytes were on the way.
            dst = h.dst_slots[i : i + per]
            self._check(h.dst_tx, h.dst_epoch, dst, True, h.id)
            return wire.scatter(data, self._spans(dst, 0, bb, h.id))

        n = sum(await asyncio.gather(*(chunk(i) for i in range(0, len(h.src_slots), per))))
        self.counters["bytes_in"] += n
        return wire.Ok(id=h.id, nbytes=n)

    # ---------------------------------------------------------------- shutdown

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.peers.aclose()
        self.sock.close(linger=0)


def _pack(spans: list[memoryview]) -> list[Any]:
    """Small spans go as one packed buffer, large ones as zero-copy frames."""
    if len(spans) > 1 and sum(len(s) for s in spans) < PACK_BELOW * len(spans):
        return [b"".join(spans)]
    return spans
