"""The store's data plane: KV bytes through the transfer engine, coordinated over ZeroMQ.

Lifecycle of a request on the ROUTER (see :mod:`services.transfer.wire` for frames):

    received -> parsed (bad frame: ERR reply, loop goes on)
      OPEN / CLOSE (from a peer store; a same-host one's on the Unix socket below,
            ``grant_requests_local`` counts them; a ``quiet`` CLOSE gets no reply, its
            sender not waiting for the verdict): the serving side,
            :class:`~services.store.node.grant_server.GrantServer`: a grant on our
            slots, answered at once.
      SHIP / PULL / LEASE (from a local worker; also on the Unix socket of
            ``local_channel``, which spares a same-host worker ZeroMQ's I/O threads):
            the initiating side, :class:`~services.store.node.initiator.TransferInitiator`,
            each run as its own task: it OPENs a grant on the peer, moves the bytes,
            CLOSEs.
    grant sweep: served grants past their ttl expire, idle leases are closed.

:class:`DataPlane` is both sides over one state: the pool checks (``_check``), the
:class:`~services.store.node.fence.SlotFence`, the transfer engines and the counters.

Who may ask (see :mod:`services.transfer.data_auth` and SECURITY.md): every ROUTER message and
reply carries a MAC under the run's data key; one without a valid MAC is dropped with
no reply. A grant is a capability: GRANTED carries a random token, its CLOSE and every
TCP transfer under it must present it (the TCP receiver checks each request against
the token's grant: its slots, its direction, the sender session that used it first).
A SHIP, PULL or LEASE goes only to a store the node registry knows (``known_peer``:
the store service's view of StoreInfo announcements), at its announced address.

Transports, best first: RDMA when both stores have a device, shared memory when the
peer's segment is visible on this host, else multi-stream TCP (the TCP receiver checks
every write against the fence on its own thread, see ``ArenaGuard``). Bytes moved as
initiator are counted per transport (``tcp_bytes``, ``shm_bytes``, ``rdma_bytes``).
A shared-memory copy up to ``SHM_ON_LOOP_MAX`` runs on the event loop (cheaper than a
thread hop; from ``SHM_SPLIT_MIN`` on, split across ``shm_copy_threads`` threads); a TCP
transfer to a connected peer is submitted from it (the stream threads send); any other
transfer runs on a small thread pool.
"""

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
import zmq
import zmq.asyncio
from opentelemetry import trace

from bus_schemas.control import Refused, TxDone
from services.common.tasks import cancel_and_wait
from services.store.arena import Arena
from services.store.node.fence import ArenaGuard, SlotFence
from services.store.node.grant_server import GrantServer
from services.store.node.initiator import (
    LEASE_IDLE_S,
    SHM_ON_LOOP_MAX,
    TRANSPORTS,
    TransferInitiator,
)
from services.store.node.shared_gens import OwnGens, PeerGens
from services.store.pool.block_pool import BlockPool
from services.transfer import backends, data_auth, wire
from services.transfer.backends import TransportError
from services.transfer.backends import shm as shm_transport
from services.transfer.batch_api import TransferEngine
from services.transfer.channel import ChannelError, PeerPool, tune
from services.transfer.local_channel import LocalServer
from tracing import extract, tracer

log = structlog.get_logger()

# Transfers get ``peer_timeout_s`` plus this much time per byte (a floor of 50 MB/s).
SECONDS_PER_BYTE = 1 / 50e6
# A shared-memory copy this big or bigger is split across ``shm_copy_threads`` threads
# (the copying one and helpers): below it, waking a helper costs what it saves.
SHM_SPLIT_MIN = 4 << 20
# What the two sides define, named here too: the store service and the tests read them.
__all__ = ["LEASE_IDLE_S", "SHM_ON_LOOP_MAX", "TRANSPORTS", "DataPlane"]


class DataPlane(GrantServer, TransferInitiator):
    """The store's data plane: grants for peers, ships and pulls for workers, over ZeroMQ."""

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
        transports: tuple[str, ...] = TRANSPORTS,
        tcp_streams: int = 4,
        sweep_interval_s: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
        local_dir: str | None = shm_transport.SEG_DIR,
        shm_copy_threads: int = 2,
        key: bytes | None = None,
        known_peer: Callable[[str], Awaitable[bool]] | None = None,
        peer_socket: Callable[[str], str] | None = None,
    ) -> None:
        """``key``: the run's data key (default: :func:`services.transfer.data_auth.data_key`);
        ``known_peer(addr)``: whether ``addr`` is a store of the node registry (waiting
        briefly for its announcement); None lets a ship go anywhere (tests).
        ``peer_socket(addr)``: the Unix socket of the store at ``addr`` (its StoreInfo's
        ``ctl_path``), over which our OPEN and CLOSE go when it shares this host."""
        self.key = key or data_auth.data_key()
        self.macs = data_auth.Macs(self.key)
        self.known_peer = known_peer
        self.pool = pool
        self.arena = arena
        self.epoch = epoch
        shm_ok = "shm" in transports and backends.availability("shm").ok
        # Same-host writers read the slot generations themselves (see shared_gens).
        self.own_gens = OwnGens(arena.name, arena.capacity) if shm_ok else None
        self.peer_gens = PeerGens()
        # The pool's free list from now on: freed slots pass through the fence.
        self.fence = SlotFence(
            arena.capacity, gens=self.own_gens.view if self.own_gens is not None else None
        )
        pool.use_free_list(self.fence)
        self.peer_timeout_s = peer_timeout_s
        self.sweep_interval_s = sweep_interval_s
        self.clock = clock
        self.peers = PeerPool(ctx, max_peers=max_peers, macs=self.macs, local_path=peer_socket)
        self.sock = ctx.socket(zmq.ROUTER)
        tune(self.sock)
        if port:
            self.sock.bind(f"tcp://{host}:{port}")
        else:
            port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.data_addr = f"tcp://{advertise_host or host}:{port}"
        self.guard = ArenaGuard(self.fence, arena.block_bytes, capabilities=True)
        self.engines: dict[str, TransferEngine] = {}
        self.regions: dict[str, int] = {}
        for name in (t for t in TRANSPORTS if t in transports):
            avail = backends.availability(name)
            if not avail.ok:
                log.info("transport_skipped", transport=name, reason=avail.reason)
                continue
            sender: dict[str, Any] = {}
            if name == "tcp":
                sender = {"streams": tcp_streams, "key": self.key}
            elif name == "shm" and shm_copy_threads > 1:
                sender = {"split_min": SHM_SPLIT_MIN, "split_threads": shm_copy_threads - 1}
            receiver: dict[str, Any] = {}
            if name == "tcp":
                receiver = {
                    "host": host,
                    "port": 0,
                    "advertise_host": advertise_host or host,
                    "guard": self.guard,
                    "key": self.key,
                }
            elif name == "rdma":  # its bootstrap socket (it advertises what it binds)
                receiver = {"host": advertise_host or host}
            engine = TransferEngine(name, sender_opts=sender, receiver_opts=receiver)
            self.regions[name] = engine.register_local_memory(arena.buf, name=arena.name)
            self.engines[name] = engine
        if "tcp" not in self.engines:
            raise TransportError("unavailable", "the TCP transport is needed across hosts")
        self.guard.region = self.regions["tcp"]
        self.segments = {name: e.segment for name, e in self.engines.items()}
        self._init_initiator()
        self._init_grants()
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "ships",
                "pulls",
                "writes_in",
                "reads_in",
                "blocks_written_remote",
                "blocks_read_remote",
                "bytes_in",
                "bytes_out",
                "local_copies",
                "commits_on_ship",
                "transfer_errors",
                "bad_frames",
                "unauthenticated",
                "unknown_peers",
                "tcp_bytes",
                "shm_bytes",
                "rdma_bytes",
                "grants_served",
                "grant_requests_local",
                "grants_expired",
                "grants_fenced",
            ),
            0,
        )
        self._tasks: set[asyncio.Task] = set()
        self._worker_ops: dict[wire.Kind, Callable] = {
            wire.Kind.SHIP: self.ship,
            wire.Kind.PULL: self.pull,
            wire.Kind.LEASE: self.lease,
        }
        # A same-host worker's requests, without ZeroMQ (see local_channel).
        self.local: LocalServer | None = None
        if local_dir is not None and os.path.isdir(local_dir):
            path = os.path.join(local_dir, f"{arena.name}.ctl")
            self.local = LocalServer(path, self._serve_local)

    async def commit(self, tx_id: str, request_id: str) -> TxDone | Refused:
        """Commit ``tx_id`` once no peer writes into its slots (bytes still landing must
        not become a cached block): a TxCommit's, or a prefill's last ship's."""
        if not await self.settled(tx_id, self.peer_timeout_s):
            log.info("commit_refused", tx_id=tx_id, reason="busy")
            return Refused(
                reason="busy",
                message=f"transfers into {tx_id} are still open; commit once they closed",
            )
        result = self.pool.commit(tx_id, request_id)
        if isinstance(result, Refused):
            log.info("commit_refused", tx_id=tx_id, reason=result.reason)
        return result

    def security_counters(self) -> dict[str, int]:
        """What strangers met: the TCP receiver's refusals and bounds, unauthorized ops."""
        rx = getattr(self.engines["tcp"].receiver, "counters", {})
        out = {f"tcp_rx_{k}": v for k, v in rx.items() if isinstance(v, int)}
        out["unauthorized_ops"] = self.fence.counters["unauthorized_ops"]
        out["open_capabilities"] = self.fence.capabilities
        return out

    @property
    def ctl_path(self) -> str:
        return self.local.path if self.local is not None else ""

    # ---------------------------------------------------------------- loop

    async def run(self) -> None:
        """Serve the ROUTER (and expire grants) until cancelled."""
        sweeper = asyncio.get_running_loop().create_task(self._sweep(), name="store:grant-sweep")
        if self.local is not None:
            await self.local.start()
        try:
            await self._serve()
        finally:
            sweeper.cancel()

    async def _serve(self) -> None:
        while True:
            parts = await self.sock.recv_multipart(copy=False)
            if len(parts) < 2:
                continue
            ident, rest = parts[0].bytes, parts[1:]
            header: Any = None
            try:
                kind, header = wire.parse(rest, self.macs)
                if kind in (wire.Kind.OPEN, wire.Kind.CLOSE):
                    out = self._serve_grant(kind, header)
                    if not _quiet(header):
                        await self._reply(ident, out)
                elif kind in self._worker_ops:
                    self._spawn(self._answer(ident, self._worker_ops[kind], header))
                else:
                    raise wire.WireError(
                        f"{kind.name} is not a request of the data plane", req_id=header.id
                    )
            except wire.WireError as e:
                if e.code == "unauthenticated":  # a stranger: no reply, nothing revealed
                    self.counters["unauthenticated"] += 1
                    log.debug("data_plane_unauthenticated")
                    continue
                self.counters["bad_frames" if e.code == "bad_frame" else "transfer_errors"] += 1
                log.warning("data_plane_refused", code=e.code, error=str(e))
                if not _quiet(header):
                    await self._reply(ident, wire.Err(id=e.req_id, code=e.code, message=str(e)))
            except Exception as e:  # noqa: BLE001 - a bug in one request must not stop the loop
                log.exception("data_plane_request_failed")
                rid = getattr(header, "id", -1)
                msg = f"{type(e).__name__}: {e}"
                if not _quiet(header):
                    await self._reply(ident, wire.Err(id=rid, code="internal", message=msg))

    def _serve_grant(self, kind: wire.Kind, header: Any) -> Any:
        """A peer's OPEN or CLOSE: the reply (WireError raises)."""
        # A write (read) grant's span is store.write (store.read), a child of the peer's
        # store.ship (store.pull).
        name = (
            "store.close"
            if kind == wire.Kind.CLOSE
            else "store.write"
            if header.write
            else "store.read"
        )
        with tracer().start_as_current_span(
            name, context=extract(getattr(header, "trace", {})), kind=trace.SpanKind.SERVER
        ):
            return self.serve_open(header) if kind == wire.Kind.OPEN else self.serve_close(header)

    async def _reply(self, ident: bytes, header: Any) -> None:
        await self.sock.send_multipart([ident, *wire.frames(header, self.macs)])

    async def _answer(self, ident: bytes, op: Callable, header: Any) -> None:
        reply = await self._serve_op(op, header)
        try:
            await self._reply(ident, reply)
        except zmq.ZMQError:
            pass

    def _serve_local(self, kind: wire.Kind, header: Any, reply: Callable[[Any], None]) -> None:
        if kind in (wire.Kind.OPEN, wire.Kind.CLOSE):  # a same-host peer store's
            self.counters["grant_requests_local"] += 1
            if _quiet(header):
                reply = _dropped
            try:
                reply(self._serve_grant(kind, header))
            except wire.WireError as e:
                self.counters["transfer_errors"] += 1
                log.warning("data_plane_refused", code=e.code, error=str(e))
                reply(wire.Err(id=e.req_id, code=e.code, message=str(e)))
            except Exception as e:  # noqa: BLE001 - a bug in one request must not stop the store
                log.exception("data_plane_request_failed")
                reply(wire.Err(id=header.id, code="internal", message=f"{type(e).__name__}: {e}"))
            return
        op = self._worker_ops.get(kind)
        if op is None:
            reply(
                wire.Err(
                    id=header.id,
                    code="bad_request",
                    message=f"{kind.name} is not a request of the data plane",
                )
            )
            return

        async def answer() -> None:
            reply(await self._serve_op(op, header))

        self._spawn(answer())

    async def _serve_op(self, op: Callable, header: Any) -> Any:
        name = (
            "store.ship"
            if isinstance(header, wire.Ship)
            else "store.pull"
            if isinstance(header, wire.Pull)
            else "store.lease"
        )
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
        return reply

    # ---------------------------------------------------------------- checks

    def _spans(self, slots: list[int], offset: int, length: int, req_id: int) -> list[memoryview]:
        try:
            return self.arena.spans(slots, offset, length)
        except IndexError as e:
            raise wire.WireError(str(e), code="bad_request", req_id=req_id) from None

    def _check(self, tx: str, epoch: int, slots: list[int], write: bool, req_id: int) -> None:
        if epoch != self.epoch:
            raise wire.WireError(
                f"transaction {tx} is not from this store's epoch", code="epoch", req_id=req_id
            )
        why = (self.pool.check_write if write else self.pool.check_read)(tx, slots)
        if why is not None:
            raise wire.WireError(why, code="forbidden", req_id=req_id)

    async def _known(self, addr: str, req_id: int) -> None:
        """Refuse a peer the node registry does not know at ``addr``."""
        if self.known_peer is None or await self.known_peer(addr):
            return
        self.counters["unknown_peers"] += 1
        raise wire.WireError(
            "not the data address of a store this node knows", code="unknown_peer", req_id=req_id
        )

    def _deadline(self, nbytes: int) -> float:
        return self.peer_timeout_s + nbytes * SECONDS_PER_BYTE

    # ---------------------------------------------------------------- grants we serve

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval_s)
            self.expire_grants()
            self.retire_leases()

    # ---------------------------------------------------------------- worker -> store

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---------------------------------------------------------------- shutdown

    async def close(self) -> None:
        await cancel_and_wait(list(self._tasks))
        await self.peers.aclose()
        self.sock.close(linger=0)
        if self.local is not None:
            await self.local.close()
        self.peer_gens.close()
        if self.own_gens is not None:
            self.fence.unshare_gens()
            self.own_gens.close()
        self._threads.shutdown(
            wait=False, cancel_futures=True
        )  # a stuck peer must not hold up exit
        for name, engine in self.engines.items():
            engine.unregister_local_memory(self.regions[name])
            engine.close()


def _quiet(header: Any) -> bool:
    """A CLOSE whose sender wants no reply (it does not wait for the verdict)."""
    return isinstance(header, wire.Close) and header.quiet


def _dropped(_reply: Any) -> None:
    pass
