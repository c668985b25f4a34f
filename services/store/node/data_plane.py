"""The store's data plane: KV bytes through the transfer engine, coordinated over ZeroMQ.

Lifecycle of a request on the ROUTER (see :mod:`services.transfer.wire` for frames):

    received -> parsed (bad frame: ERR reply, loop goes on)
      OPEN  (from a peer store): checked against the pool (slots of a live transaction
            of this epoch; writes only into slots the transaction allocated); a grant is
            opened on the slots in the :class:`~services.store.node.fence.SlotFence` and
            GRANTED names this store's transfer segments. Answered at once.
      CLOSE (from a peer store): the grant ends: OK when its slots stayed live, else
            ERR ``fenced`` (the transaction was aborted or expired meanwhile: the bytes
            are discarded, the slots are reused only now that nothing moves into them).
      SHIP / PULL / LEASE (from a local worker; also on the Unix socket of
            ``local_channel``, which spares a same-host worker ZeroMQ's I/O threads):
            run as their own task:
            SHIP  hold our source slots (a read grant on our fence), take the lease on
                  the peer's destination slots (a write grant OPENed once per
                  destination transaction and reused by its ships, see ``_Lease``),
                  WRITE the spans into its arena; OK once the bytes are in: over TCP
                  the peer's receiver acked each write after checking its slots were
                  live; over shared memory the peer's slot generations, read after
                  the copy, are unchanged (see ``shared_gens``). The ``last`` ship
                  CLOSEs the lease, unawaited; over RDMA, or to a peer that shares no
                  generations, nothing checked the bytes, so the OK waits for the
                  CLOSE verdict: a request's last OK says the peer accepted every byte.
            LEASE OPEN the lease ahead of the ships (OK once granted).
            PULL  hold our destination slots (a write grant), OPEN a read grant on the
                  peer, READ its slots into ours, CLOSE; OK once both ends stayed live.
            A ship or pull whose other end is this very store is a local memcpy.
    grant sweep: a served grant past its ttl is closed as failed; a same-host writer's
            (it copies into our memory itself) gets one more ttl, never more: nothing
            a requester says of its own process (a pid) keeps a grant open.

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
import hmac
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import structlog
import zmq
import zmq.asyncio
from opentelemetry import trace

from services.common.tasks import cancel_and_wait
from services.store.arena import Arena
from services.store.node.fence import ArenaGuard, Grant, SlotFence
from services.store.node.shared_gens import OwnGens, PeerGens
from services.store.pool.block_pool import BlockPool
from services.transfer import backends, data_auth, wire
from services.transfer.backends import Opcode, Poll, TransportError
from services.transfer.backends import shm as shm_transport
from services.transfer.batch_api import TransferApiError, TransferEngine, TransferRequest
from services.transfer.channel import ChannelError, PeerPool, next_id, tune
from services.transfer.local_channel import LocalServer
from tracing import extract, inject, tracer

# Peer segments whose reachability over shm is remembered, at most.
MAX_VISIBLE = 4096
log = structlog.get_logger()

TRANSPORTS = ("rdma", "shm", "tcp")  # preference order
# Transfers get ``peer_timeout_s`` plus this much time per byte (a floor of 50 MB/s).
SECONDS_PER_BYTE = 1 / 50e6
# A shared-memory copy up to this size runs on the event loop (a few ms at most); a
# bigger one on a transfer thread, so the store keeps answering meanwhile.
SHM_ON_LOOP_MAX = 64 << 20
# A shared-memory copy this big or bigger is split across ``shm_copy_threads`` threads
# (the copying one and helpers): below it, waking a helper costs what it saves.
SHM_SPLIT_MIN = 4 << 20
# A lease no ship used for this long since its last ship is closed: its request stopped
# between ships (a request's ships follow its layers' compute, milliseconds apart; its
# last ship closes the lease at once). Until then the peer keeps the aborted
# transaction's slots parked. A lease opened ahead (LEASE, as a compute starts) and not
# shipped through yet waits for its first ship as long as its grant lasts: the compute
# before it may take longer than this, and closing it would only cost the ship an OPEN.
LEASE_IDLE_S = 1.0


@dataclass
class _Lease:
    """A write grant a peer gave us on slots of one of its transactions, reused by every
    ship into those slots until the ``last`` one (a request's layer ships: one OPEN and
    one CLOSE instead of one each per ship). Ships through it take turns (``lock``).
    The peer revokes it when the transaction ends: over TCP its receiver then refuses
    the next write; over shared memory the bytes land in slots the peer keeps parked
    until our CLOSE, whose verdict is ``fenced``."""

    key: tuple[str, str, int, tuple[int, ...]]  # peer, tx, epoch, slots
    opened: wire.Open
    granted: "asyncio.Task[wire.Granted]"
    lock: asyncio.Lock
    latest: float = 0.0  # monotonic: no copy starts after this (the peer's ttl runs out)
    used: float = 0.0  # monotonic: last ship through it
    moved: int = 0  # bytes written under it
    closed: bool = False


@dataclass
class _Served:
    """A grant this store gave a peer."""

    grant: Grant
    tx: str
    nbytes: int
    deadline: float
    same_host: bool
    token: bytes
    grace: float = 0.0  # a same-host writer's grant is closed at deadline + grace


def pieces(
    src: list[int], dst: list[int], offset: int, length: int, block_bytes: int
) -> list[tuple[int, int, int]]:
    """``(src_byte, dst_byte, n)`` runs of the same span of each slot pair, whole slots
    numbered consecutively on both sides merged into one run."""
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        so, do = s * block_bytes + offset, d * block_bytes + offset
        if out and length == block_bytes:
            ps, pd, pn = out[-1]
            if ps + pn == so and pd + pn == do:
                out[-1] = (ps, pd, pn + length)
                continue
        out.append((so, do, length))
    return out


class DataPlane:
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
    ) -> None:
        """``key``: the run's data key (default: :func:`services.transfer.data_auth.data_key`);
        ``known_peer(addr)``: whether ``addr`` is a store of the node registry (waiting
        briefly for its announcement); None lets a ship go anywhere (tests)."""
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
        self.peers = PeerPool(ctx, max_peers=max_peers, macs=self.macs)
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
        # TCP targets whose streams are connected (a transfer to them went through), and
        # the size above which a submit only queues slices for the stream threads.
        self._tcp_warm: set[str] = set()
        self._tcp_inline_max = int(getattr(self.engines["tcp"].sender, "inline_max", 1 << 62))
        self.segments = {name: e.segment for name, e in self.engines.items()}
        self._threads = ThreadPoolExecutor(max_workers=4, thread_name_prefix="store-xfer")
        self._served: dict[int, _Served] = {}
        self._leases: dict[tuple[str, str, int, tuple[int, ...]], _Lease] = {}
        self.lease_idle_s = LEASE_IDLE_S
        self._by_tx: dict[str, set[int]] = {}
        self._settle: dict[str, asyncio.Event] = {}
        self._visible: dict[str, bool] = {}
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
                "transfer_errors",
                "bad_frames",
                "unauthenticated",
                "unknown_peers",
                "tcp_bytes",
                "shm_bytes",
                "rdma_bytes",
                "grants_served",
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
                    # A write (read) grant's span is store.write (store.read), a child
                    # of the peer's store.ship (store.pull).
                    name = (
                        "store.close"
                        if kind == wire.Kind.CLOSE
                        else "store.write"
                        if header.write
                        else "store.read"
                    )
                    with tracer().start_as_current_span(
                        name,
                        context=extract(getattr(header, "trace", {})),
                        kind=trace.SpanKind.SERVER,
                    ):
                        out = (
                            self.serve_open(header)
                            if kind == wire.Kind.OPEN
                            else self.serve_close(header)
                        )
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
                await self._reply(ident, wire.Err(id=e.req_id, code=e.code, message=str(e)))
            except Exception as e:  # noqa: BLE001 - a bug in one request must not stop the loop
                log.exception("data_plane_request_failed")
                rid = getattr(header, "id", -1)
                msg = f"{type(e).__name__}: {e}"
                await self._reply(ident, wire.Err(id=rid, code="internal", message=msg))

    async def _reply(self, ident: bytes, header: Any) -> None:
        await self.sock.send_multipart([ident, *wire.frames(header, self.macs)])

    async def _answer(self, ident: bytes, op: Callable, header: Any) -> None:
        reply = await self._serve_op(op, header)
        try:
            await self._reply(ident, reply)
        except zmq.ZMQError:
            pass

    def _serve_local(self, kind: wire.Kind, header: Any, reply: Callable[[Any], None]) -> None:
        op = self._worker_ops.get(kind)
        if op is None:
            reply(
                wire.Err(
                    id=header.id,
                    code="bad_request",
                    message=f"{kind.name} is not a worker's request (SHIP, PULL, LEASE)",
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

    def serve_open(self, h: wire.Open) -> wire.Granted:
        """A peer asks to move bytes of our slots: grant it if they are live."""
        if len(set(h.slots)) != len(h.slots):
            raise wire.WireError("slots repeat", code="bad_request", req_id=h.id)
        self._check(h.tx, h.epoch, h.slots, h.write, h.id)
        self._spans(h.slots, h.offset, h.length, h.id)
        g = self.fence.open(h.slots, h.write)
        nbytes = len(h.slots) * h.length
        ttl = self._deadline(nbytes) + self.peer_timeout_s
        token = secrets.token_bytes(16)
        same_host = h.write and bool(h.origin) and self._reachable("shm", h.origin)
        self._served[g.id] = _Served(
            g, h.tx, nbytes, self.clock() + ttl, same_host, token, ttl if same_host else 0.0
        )
        self.fence.admit(token, g)
        self._by_tx.setdefault(h.tx, set()).add(g.id)
        self.counters["grants_served"] += 1
        shared = h.write and self.own_gens is not None
        return wire.Granted(
            id=h.id,
            grant=g.id,
            segments=self.segments,
            regions=self.regions,
            ttl_s=ttl,
            gens=list(g.gens) if shared else [],
            gens_shm=self.own_gens.name if shared and self.own_gens is not None else "",
            token=token,
        )

    def serve_close(self, h: wire.Close) -> wire.Ok:
        s = self._served.get(h.grant)
        if s is not None and not hmac.compare_digest(s.token, h.token):
            s = None  # not its holder: answered as an unknown grant
        if s is not None:
            self._end(h.grant)
        if s is None:
            raise wire.WireError(
                f"no open grant {h.grant} (it expired)", code="fenced", req_id=h.id
            )
        if not self.fence.close(s.grant):
            self.counters["grants_fenced"] += 1
            raise wire.WireError(
                f"transaction {s.tx} lost slots while bytes moved (aborted or "
                "expired): fenced, discarded",
                code="fenced",
                req_id=h.id,
            )
        # A lease's CLOSE says how many bytes its ships moved (several spans, or none).
        nbytes = h.nbytes if h.ok else 0
        if h.ok:
            n = len(s.grant.slots)
            if s.grant.write:
                self.counters["writes_in"] += 1
                self.counters["blocks_written_remote"] += n
                self.counters["bytes_in"] += nbytes
            else:
                self.counters["reads_in"] += 1
                self.counters["blocks_read_remote"] += n
                self.counters["bytes_out"] += nbytes
        return wire.Ok(id=h.id, nbytes=nbytes)

    def open_grants(self, tx: str) -> int:
        """Grants peers hold on ``tx``'s slots."""
        return len(self._by_tx.get(tx, ()))

    async def settled(self, tx: str, timeout: float) -> bool:
        """Wait until no peer holds a grant on ``tx``'s slots (a commit waits for this:
        bytes must not land in a block once it is cached); False after ``timeout``."""
        if tx not in self._by_tx:
            return True
        ev = self._settle.setdefault(tx, asyncio.Event())
        try:
            async with asyncio.timeout(timeout):
                await ev.wait()
        except TimeoutError:
            return tx not in self._by_tx
        return True

    def expire_grants(self, now: float | None = None) -> list[int]:
        """Close (as failed) every served grant past its ttl; returns their ids."""
        now = self.clock() if now is None else now
        out = []
        for gid, s in list(self._served.items()):
            if s.deadline + s.grace > now:
                continue  # (a same-host writer copies into our memory itself: one more ttl)
            self._end(gid)
            self.fence.close(s.grant)
            self.counters["grants_expired"] += 1
            log.warning("grant_expired", grant=gid, tx=s.tx, write=s.grant.write)
            out.append(gid)
        return out

    def _end(self, gid: int) -> _Served | None:
        s = self._served.pop(gid, None)
        if s is not None:
            self.fence.revoke(s.token)
            ids = self._by_tx.get(s.tx)
            if ids is not None:
                ids.discard(gid)
                if not ids:
                    del self._by_tx[s.tx]
                    ev = self._settle.pop(s.tx, None)
                    if ev is not None:
                        ev.set()
        return s

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval_s)
            self.expire_grants()
            self.retire_leases()

    # ---------------------------------------------------------------- worker -> store

    async def ship(self, h: wire.Ship) -> wire.Ok:
        """Our slots' span -> the same span of the peer's slots (see module doc)."""
        if len(h.src_slots) != len(h.dst_slots):
            raise wire.WireError("src_slots and dst_slots differ in length", "bad_request", h.id)
        self._check(h.src_tx, h.src_epoch, h.src_slots, False, h.id)
        spans = self._spans(h.src_slots, h.offset, h.length, h.id)
        self.counters["ships"] += 1
        if h.dst_addr != self.data_addr:
            await self._known(h.dst_addr, h.id)
        if h.dst_addr == self.data_addr:
            self._check(h.dst_tx, h.dst_epoch, h.dst_slots, True, h.id)
            n = wire.scatter(spans, self._spans(h.dst_slots, h.offset, h.length, h.id))
            self.counters["local_copies"] += 1
            return wire.Ok(id=h.id, nbytes=n)
        nbytes = len(h.src_slots) * h.length
        runs = pieces(h.src_slots, h.dst_slots, h.offset, h.length, self.arena.block_bytes)
        while True:
            lease = self._lease(h.dst_addr, h.dst_tx, h.dst_epoch, h.dst_slots)
            await lease.lock.acquire()
            if not lease.closed:
                break
            lease.lock.release()  # a ship ahead of us ended it: take a new one
        mine = self.fence.open(h.src_slots, write=False)
        try:
            try:
                granted = await self._granted(lease)
            except BaseException:
                self.fence.close(mine)
                raise
            name, err, mine_ok = await self._transfer(
                granted, mine, Opcode.WRITE, runs, nbytes, lease.latest
            )
            ok = err is None and mine_ok is True
            # Over TCP the peer's receiver checked each write as it landed: the verdict
            # is in. A copy into its memory was checked by nobody: over shm the peer's
            # slot generations, read here, are the verdict; else (RDMA, a peer that does
            # not share them) the CLOSE verdict is, and the OK waits for it.
            verdict: bool | None = True if name == "tcp" else None
            if ok and name == "shm":
                verdict = self.peer_gens.unchanged(
                    granted.gens_shm, lease.opened.slots, granted.gens
                )
            fenced = verdict is False
            ok = ok and not fenced
            lease.used = time.monotonic()
            if ok:
                lease.moved += nbytes
            if not ok or h.last:
                await self._end_lease(lease, ok, wait=not ok or verdict is None)
        finally:
            lease.lock.release()
        self._raise(Opcode.WRITE, granted, err, mine_ok, lease.opened.id)
        if fenced:
            raise wire.WireError(
                "the peer's slots were freed while the bytes moved (transaction aborted "
                "or expired): fenced, discarded",
                code="fenced",
                req_id=h.id,
            )
        self.counters[f"{name}_bytes"] += nbytes
        self.counters["bytes_out"] += nbytes
        return wire.Ok(id=h.id, nbytes=nbytes)

    async def lease(self, h: wire.Lease) -> wire.Ok:
        """Open the lease that ships into ``h.dst_slots`` will use (see ``_Lease``)."""
        if h.dst_addr != self.data_addr:  # a ship within this store needs no grant
            await self._known(h.dst_addr, h.id)
            await self._granted(self._lease(h.dst_addr, h.dst_tx, h.dst_epoch, h.dst_slots))
        return wire.Ok(id=h.id)

    def _lease(self, peer: str, tx: str, epoch: int, slots: list[int]) -> _Lease:
        """The lease on ``slots`` of ``tx`` at ``peer``: the open one while its grant has
        time left, else a new one (its OPEN goes out now)."""
        key = (peer, tx, epoch, tuple(slots))
        lease = self._leases.get(key)
        if lease is not None and lease.granted.done() and time.monotonic() > lease.latest:
            self._retire(lease)  # the peer may expire it: start over
            lease = None
        if lease is None:
            whole = self.arena.block_bytes
            opened = wire.Open(
                id=next_id(),
                tx=tx,
                epoch=epoch,
                slots=list(slots),
                offset=0,
                length=whole,
                write=True,
                origin=self.segments.get("shm", ""),
                trace=inject(),
            )
            task = asyncio.get_running_loop().create_task(self._open(peer, opened))
            lease = _Lease(key, opened, task, asyncio.Lock(), used=time.monotonic())
            self._leases[key] = lease
        return lease

    async def _open(self, peer: str, opened: wire.Open) -> wire.Granted:
        timeout = self._deadline(len(opened.slots) * opened.length)
        _, granted = await self.peers.request(peer, opened, timeout=timeout)
        return granted

    async def _granted(self, lease: _Lease) -> wire.Granted:
        """The lease's grant (waiting for its OPEN); a refused OPEN drops the lease."""
        try:
            granted = await asyncio.shield(lease.granted)
        except BaseException:
            if lease.granted.done() and self._leases.get(lease.key) is lease:
                del self._leases[lease.key]
                lease.closed = True
            raise
        if not lease.latest:
            # Copies into a same-host peer's memory must not start once its grant may
            # have expired: the peer gives us ttl_s from when it got our OPEN.
            lease.latest = time.monotonic() + max(0.0, granted.ttl_s - self.peer_timeout_s)
        return granted

    async def _end_lease(self, lease: _Lease, ok: bool, wait: bool) -> None:
        """CLOSE the lease (its ``moved`` bytes, or failed); with ``wait``, an ERR verdict
        (``fenced``: the transaction lost its slots meanwhile) raises."""
        if lease.closed:
            return
        lease.closed = True
        if self._leases.get(lease.key) is lease:
            del self._leases[lease.key]
        if not lease.granted.done() or lease.granted.cancelled():
            return
        if lease.granted.exception() is not None:
            return  # never granted: nothing to close
        peer = lease.key[0]
        granted = lease.granted.result()
        close = wire.Close(
            id=next_id(),
            grant=granted.grant,
            ok=ok,
            nbytes=lease.moved if ok else 0,
            token=granted.token,
        )
        timeout = self._deadline(lease.moved)
        if not wait:
            self._spawn(self._close_later(peer, close, timeout))
            return
        try:
            await self.peers.request(peer, close, timeout=timeout)
        except ChannelError as e:
            if not ok:
                return  # the ship failed already; the grant expires over there
            if e.code == "fenced":
                raise wire.WireError(
                    f"the peer discarded the bytes: {e.message}", code="fenced", req_id=close.id
                ) from None
            raise

    def _retire(self, lease: _Lease) -> None:
        """Close a lease no ship will finish (idle, or out of time) once it is free."""
        if self._leases.get(lease.key) is lease:
            del self._leases[lease.key]

        async def close() -> None:
            async with lease.lock:
                await self._end_lease(lease, ok=lease.moved > 0, wait=False)

        self._spawn(close())

    def retire_leases(self, now: float | None = None) -> int:
        """Close leases idle for ``lease_idle_s`` after a ship (their request stopped
        between ships: the peer's commit must not wait on them) or past their grant's
        time (one opened ahead and never shipped through too); how many."""
        now = time.monotonic() if now is None else now
        n = 0
        for lease in list(self._leases.values()):
            if lease.lock.locked() or not lease.granted.done():
                continue
            idle = lease.moved > 0 and now - lease.used >= self.lease_idle_s
            if idle or (lease.latest and now > lease.latest):
                self._retire(lease)
                n += 1
        return n

    async def pull(self, h: wire.Pull) -> wire.Ok:
        """The peer's whole slots -> ours (see module doc)."""
        if len(h.src_slots) != len(h.dst_slots):
            raise wire.WireError("src_slots and dst_slots differ in length", "bad_request", h.id)
        bb = self.arena.block_bytes
        self._check(h.dst_tx, h.dst_epoch, h.dst_slots, True, h.id)
        dst = self._spans(h.dst_slots, 0, bb, h.id)
        self.counters["pulls"] += 1
        if h.src_addr != self.data_addr:
            await self._known(h.src_addr, h.id)
        if h.src_addr == self.data_addr:
            self._check(h.src_tx, h.src_epoch, h.src_slots, False, h.id)
            n = wire.scatter(self._spans(h.src_slots, 0, bb, h.id), dst)
            self.counters["local_copies"] += 1
            return wire.Ok(id=h.id, nbytes=n)
        nbytes = len(h.src_slots) * bb
        opened = wire.Open(
            id=next_id(),
            tx=h.src_tx,
            epoch=h.src_epoch,
            slots=h.src_slots,
            offset=0,
            length=bb,
            write=False,
            origin=self.segments.get("shm", ""),
            trace=inject(),
        )
        runs = pieces(h.src_slots, h.dst_slots, 0, bb, bb)
        await self._move(
            h.src_addr,
            opened,
            self.fence.open(h.dst_slots, write=True),
            Opcode.READ,
            [(d, s, n) for s, d, n in runs],
            nbytes,
        )
        self.counters["bytes_in"] += nbytes
        return wire.Ok(id=h.id, nbytes=nbytes)

    async def _move(
        self,
        peer: str,
        opened: wire.Open,
        mine: Grant,
        opcode: Opcode,
        runs: list[tuple[int, int, int]],
        nbytes: int,
    ) -> None:
        """OPEN on ``peer``, move ``runs`` (local byte, remote byte, n), CLOSE (waited
        for). ``mine`` holds our side's slots until no byte of the batch moves any more."""
        timeout = self._deadline(nbytes)
        try:
            _, granted = await self.peers.request(peer, opened, timeout=timeout)
        except BaseException:
            self.fence.close(mine)
            raise
        latest = time.monotonic() + max(0.0, granted.ttl_s - self.peer_timeout_s)
        name, err, mine_ok = await self._transfer(granted, mine, opcode, runs, nbytes, latest)
        ok = err is None and mine_ok is True
        close = wire.Close(
            id=next_id(),
            grant=granted.grant,
            ok=ok,
            nbytes=nbytes if ok else 0,
            token=granted.token,
        )
        try:
            await self.peers.request(peer, close, timeout=timeout)
        except ChannelError:
            if ok:
                raise
        self._raise(opcode, granted, err, mine_ok, opened.id)
        self.counters[f"{name}_bytes"] += nbytes

    async def _transfer(
        self,
        granted: wire.Granted,
        mine: Grant,
        opcode: Opcode,
        runs: list[tuple[int, int, int]],
        nbytes: int,
        latest: float,
    ) -> tuple[str, tuple[str, str] | None, bool | None]:
        """Move ``runs`` (local byte, remote byte, n) under ``granted``; closes ``mine``
        once no byte moves any more. (backends, error, whether ``mine`` held)."""
        timeout = self._deadline(nbytes)
        name = "?"
        try:
            name = self._pick(granted)
            reqs = [
                TransferRequest(
                    opcode,
                    self.regions[name],
                    local,
                    n,
                    granted.segments[name],
                    granted.regions[name],
                    remote,
                    token=granted.token,
                )
                for local, remote, n in runs
            ]
            args = (name, reqs, timeout, latest, lambda: self.fence.close(mine))
            target = granted.segments[name]
            if name == "shm" and nbytes <= SHM_ON_LOOP_MAX:
                err, mine_ok = self._run(*args)  # one memcpy: cheaper than two thread hops
            elif name == "tcp" and target in self._tcp_warm and nbytes > self._tcp_inline_max:
                # Submitting only queues the slices for the stream threads (connected
                # already): no transfer thread between them and the loop.
                err, mine_ok = await self._run_on_loop(*args)
                if err is not None:
                    self._tcp_warm.discard(target)
            else:
                err, mine_ok = await asyncio.get_running_loop().run_in_executor(
                    self._threads, self._run, *args
                )
                if name == "tcp" and err is None:
                    self._tcp_warm.add(target)
        except wire.WireError as e:
            err = (e.code, str(e))
            mine_ok = self.fence.close(mine)
        return name, err, mine_ok

    def _raise(
        self,
        opcode: Opcode,
        granted: wire.Granted,
        err: tuple[str, str] | None,
        mine_ok: bool | None,
        rid: int,
    ) -> None:
        if err is not None:
            raise wire.WireError(
                f"{opcode.name} via {self._via(granted)}: {err[1]}",
                code=f"transfer_{err[0]}",
                req_id=rid,
            )
        if not mine_ok:
            raise wire.WireError(
                "our slots were freed while their bytes moved (transaction "
                "aborted or expired): fenced",
                code="fenced",
                req_id=rid,
            )

    async def _close_later(self, peer: str, close: wire.Close, timeout: float) -> None:
        try:
            await self.peers.request(peer, close, timeout=timeout)
        except ChannelError as e:  # the grant expires on its own over there
            log.warning("grant_close_failed", peer=peer, grant=close.grant, code=e.code)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _run(
        self,
        name: str,
        reqs: list[TransferRequest],
        timeout: float,
        latest: float,
        after: Callable[[], bool],
    ) -> tuple[tuple[str, str] | None, bool | None]:
        """On a transfer thread: submit one batch and wait; ``after()`` runs once no byte
        of it moves any more (here, or later on the thread that ends it when it outlives
        ``timeout``: then its result is None)."""
        engine = self.engines[name]
        if name != "tcp" and time.monotonic() > latest:
            return ("timeout", "the peer's grant may have expired before the copy started"), after()
        bid = engine.allocate_batch_id(max(1, len(reqs)))
        try:
            engine.submit_transfer(bid, reqs)
        except (TransferApiError, TransportError) as e:
            engine.free_batch_id(bid)  # nothing was started
            return (e.code, e.message), after()
        statuses = engine.wait_batch_sync(bid, timeout)
        if all(s.state in (Poll.SUCCESS, Poll.FAILED) for s in statuses):
            engine.free_batch_id(bid)
            result: bool | None = after()
        else:

            def late() -> None:
                engine.free_batch_id(bid)
                after()

            engine.on_batch_done(bid, late)
            result = None
        bad = next((s for s in statuses if s.state != Poll.SUCCESS), None)
        if bad is None:
            return None, result
        return (bad.code or "timeout", bad.error or f"did not end within {timeout:.1f}s"), result

    async def _run_on_loop(
        self,
        name: str,
        reqs: list[TransferRequest],
        timeout: float,
        latest: float,
        after: Callable[[], bool],
    ) -> tuple[tuple[str, str] | None, bool | None]:
        """``_run`` from the event loop, for a batch whose submit does not block (TCP
        requests above the sender's inline size: the stream threads send them)."""
        engine = self.engines[name]
        bid = engine.allocate_batch_id(max(1, len(reqs)))
        try:
            engine.submit_transfer(bid, reqs)
        except (TransferApiError, TransportError) as e:
            engine.free_batch_id(bid)
            return (e.code, e.message), after()
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[None] = loop.create_future()
        engine.on_batch_done(bid, lambda: loop.call_soon_threadsafe(_settle, ended))

        def late(_f: object) -> None:  # no byte of the batch moves any more
            engine.free_batch_id(bid)
            after()

        try:
            await asyncio.wait_for(asyncio.shield(ended), timeout)
        except TimeoutError:
            ended.add_done_callback(late)
            return ("timeout", f"did not end within {timeout:.1f}s"), None
        except BaseException:  # cancelled: our slots stay held until the batch ends
            ended.add_done_callback(late)
            raise
        statuses = engine.wait_batch_sync(bid, 0)
        engine.free_batch_id(bid)
        result = after()
        bad = next((s for s in statuses if s.state != Poll.SUCCESS), None)
        if bad is None:
            return None, result
        return (bad.code or "failed", bad.error or "transfer failed"), result

    def _pick(self, g: wire.Granted) -> str:
        for name in TRANSPORTS:
            seg = g.segments.get(name)
            if seg and name in self.engines and name in g.regions and self._reachable(name, seg):
                return name
        raise wire.WireError(
            f"no transport in common with the peer ({sorted(g.segments)})", code="unreachable"
        )

    def _via(self, g: wire.Granted) -> str:
        try:
            return self._pick(g)
        except wire.WireError:
            return "?"

    def _reachable(self, name: str, segment: str) -> bool:
        if name != "shm":
            return True
        seen = self._visible.get(segment)
        if seen is None:
            seen = self._visible[segment] = shm_transport.reachable(segment)
            while len(self._visible) > MAX_VISIBLE:  # peers come and go: the oldest first
                del self._visible[next(iter(self._visible))]
        return seen

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


def _settle(fut: "asyncio.Future[None]") -> None:
    if not fut.done():
        fut.set_result(None)
