"""The data plane's initiating side: a local worker's SHIP, LEASE and PULL, moved
through the transfer engine under grants OPENed on the peer store.

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
                  With ``commit_src`` (a prefill's last ship), the source transaction
                  commits here once shipped, in the wake that shipped it.
            LEASE OPEN the lease ahead of the ships (OK once granted).
            PULL  hold our destination slots (a write grant), OPEN a read grant on the
                  peer, READ its slots into ours, CLOSE; OK once both ends stayed live.
            A ship or pull whose other end is this very store is a local memcpy.

Transports, best first: RDMA when both stores have a device, shared memory when the
peer's segment is visible on this host, else multi-stream TCP. A shared-memory copy up
to ``SHM_ON_LOOP_MAX`` runs on the event loop (cheaper than a thread hop); a TCP
transfer to a connected peer is submitted from it (the stream threads send); any other
transfer runs on a small thread pool. :class:`TransferInitiator` is one side of
:class:`~services.store.node.data_plane.DataPlane`, which owns the state both sides
read and routes the frames.
"""

import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import structlog

from bus_schemas.control import Refused, TxDone
from services.store.arena import Arena
from services.store.node.fence import SlotFence, SlotGrant
from services.store.node.shared_gens import PeerGens
from services.transfer import wire
from services.transfer.backends import Opcode, Poll, TransportError
from services.transfer.backends import shm as shm_transport
from services.transfer.batch_api import TransferApiError, TransferEngine, TransferRequest
from services.transfer.channel import ChannelError, PeerPool, next_id
from tracing import inject

log = structlog.get_logger()

# Peer segments whose reachability over shm is remembered, at most.
MAX_VISIBLE = 4096
TRANSPORTS = ("rdma", "shm", "tcp")  # preference order
# A shared-memory copy up to this size runs on the event loop (a few ms at most); a
# bigger one on a transfer thread, so the store keeps answering meanwhile.
SHM_ON_LOOP_MAX = 64 << 20
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


class TransferInitiator:
    """The initiating side of the data plane: ships, leases and pulls for local workers."""

    # Set up by the DataPlane this is part of.
    arena: Arena
    fence: SlotFence
    peer_gens: PeerGens
    peers: PeerPool
    counters: dict[str, int]
    data_addr: str
    segments: dict[str, str]
    regions: dict[str, int]
    engines: dict[str, TransferEngine]
    peer_timeout_s: float
    commit: Callable[[str, str], Awaitable[TxDone | Refused]]
    _check: Callable[[str, int, list[int], bool, int], None]
    _spans: Callable[[list[int], int, int, int], list[memoryview]]
    _known: Callable[[str, int], Awaitable[None]]
    _deadline: Callable[[int], float]
    _spawn: Callable[[Any], None]

    def _init_initiator(self) -> None:
        # TCP targets whose streams are connected (a transfer to them went through), and
        # the size above which a submit only queues slices for the stream threads.
        self._tcp_warm: set[str] = set()
        self._tcp_inline_max = int(getattr(self.engines["tcp"].sender, "inline_max", 1 << 62))
        self._threads = ThreadPoolExecutor(max_workers=4, thread_name_prefix="store-xfer")
        self._leases: dict[tuple[str, str, int, tuple[int, ...]], _Lease] = {}
        self.lease_idle_s = LEASE_IDLE_S
        self._visible: dict[str, bool] = {}

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
            await self._commit_shipped(h)
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
        await self._commit_shipped(h)
        return wire.Ok(id=h.id, nbytes=nbytes)

    async def _commit_shipped(self, h: wire.Ship) -> None:
        """A prefill's last ship read its transaction's slots for the last time: commit
        it as the conductor's TxCommit would (a refusal logged, the lease left to end
        it), which then need not wake this store again."""
        if not h.commit_src:
            return
        with structlog.contextvars.bound_contextvars(request_id=h.commit_src):
            if isinstance(await self.commit(h.src_tx, h.commit_src), TxDone):
                self.counters["commits_on_ship"] += 1

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
            quiet=not wait,  # nobody reads the verdict: the peer need not wake us for it
            trace=inject(),
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
        mine: SlotGrant,
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
            trace=inject(),
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
        mine: SlotGrant,
        opcode: Opcode,
        runs: list[tuple[int, int, int]],
        nbytes: int,
        latest: float,
    ) -> tuple[str, tuple[str, str] | None, bool | None]:
        """Move ``runs`` (local byte, remote byte, n) under ``granted``; closes ``mine``
        once no byte moves any more. (transport, error, whether ``mine`` held)."""
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
            await self.peers.send(peer, close, timeout=timeout)
        except ChannelError as e:  # the grant expires on its own over there
            log.warning("grant_close_failed", peer=peer, grant=close.grant, code=e.code)

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


def _settle(fut: "asyncio.Future[None]") -> None:
    if not fut.done():
        fut.set_result(None)
