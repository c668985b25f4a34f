"""The slot fence: a write into an aborted or expired transaction's slots is discarded,
never read, and the slots are reused only once nothing moves into them any more.

* hypothesis drives the real :class:`BlockPool` over a :class:`SlotFence` free list
  (its generations in an int64 view, as in shared memory) through random interleavings
  of grant, write start, bytes landing, write end, same-host copies judged by the
  generations alone, grant close, abort, lease expiry, commit, reuse (new
  transactions) and reads;
* real sockets: a WRITE held on the TCP receiver's thread while its transaction is
  aborted, then a ship between two in-process data planes whose destination
  transaction is aborted mid-receive (TCP) or mid-copy (shared memory).
"""

import asyncio
import socket
import threading
import time

import pytest
import zmq.asyncio
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from bus_schemas.control import Refused, TxAllocate, TxDone, TxRole
from services.common.clock import ManualClock
from services.store.arena import Arena
from services.store.node.data_plane import LEASE_IDLE_S, DataPlane
from services.store.node.fence import ArenaGuard, SlotFence
from services.store.node.shared_gens import unchanged
from services.store.pool.block_pool import BlockPool
from services.transfer import local_channel, wire
from services.transfer.backends import Region
from services.transfer.backends.tcp import TcpReceiver
from services.transfer.backends.tcp.frames import HELLO, NO_TOKEN, REP, REQ, Status, recv_exact

BS = 2  # tokens per block
SLOTS = 6


def alloc(
    pool: BlockPool,
    rid: str,
    hashes: list[int],
    role: TxRole = TxRole.DECODE,
    lease_s: float = 30.0,
):
    out = pool.allocate(
        TxAllocate(
            request_id=rid,
            role=role,
            block_hashes=hashes,
            num_tokens=len(hashes) * BS,
            lease_s=lease_s,
        )
    )
    return out[0] if isinstance(out, tuple) else out  # pools that still return events too


def result(out):
    return out[0] if isinstance(out, tuple) else out


# ---------------------------------------------------------------------- unit


def test_a_freed_slot_with_an_open_grant_is_parked_until_the_grant_closes():
    f = SlotFence(4)
    a, b = f.popleft(), f.popleft()
    g = f.open([a, b], write=True)
    f.append(a)  # its transaction was aborted: a is fenced, b still live
    assert len(f) == 3 - 1 and f.parked == 1
    assert a not in [f.popleft() for _ in range(len(f))]  # a is not handed out again
    assert f.enter([a], write=True) is None  # a write starting now is refused
    assert not f.close(g)  # the grant saw its slot freed: fenced
    assert f.parked == 0 and f.popleft() == a


def test_an_op_in_flight_across_a_free_is_fenced_and_holds_the_slot():
    f = SlotFence(2)
    s = f.popleft()
    g = f.open([s], write=True)
    op = f.enter([s], write=True)
    assert op is not None
    assert f.close(g)  # the grant ends normally, the op still moves bytes
    f.append(s)
    assert f.parked == 1  # the op holds it
    assert not f.leave(op)
    assert f.parked == 0 and list(f) == [1, s]


def test_reads_need_a_read_grant_and_writes_a_write_grant():
    f = SlotFence(2)
    s = f.popleft()
    g = f.open([s], write=False)
    assert f.enter([s], write=True) is None
    op = f.enter([s], write=False)
    assert op is not None and f.leave(op) and f.close(g)
    assert f.enter([s], write=False) is None  # the grant closed


def test_guard_maps_byte_ranges_to_slots_and_passes_other_regions():
    f = SlotFence(4)
    guard = ArenaGuard(f, block_bytes=100)
    guard.region = 1
    for _ in range(4):
        f.popleft()
    f.open([1, 2], write=True)
    op, why = guard.enter(1, 150, 100, True)  # bytes 150..249: slots 1 and 2
    assert why is None and op.slots == (1, 2)
    _, why = guard.enter(1, 250, 100, True)  # slots 2 and 3: 3 has no grant
    assert why is not None and "not in slots granted" in why
    assert guard.enter(7, 0, 10, True) == (None, None)
    f.append(2)
    assert guard.leave(op) is not None  # slot 2 was freed while the bytes moved


def test_the_pool_takes_the_fence_only_while_every_slot_is_free():
    pool = BlockPool(SLOTS, BS, ManualClock())
    pool.use_free_list(SlotFence(SLOTS))
    assert pool.free_blocks == SLOTS
    assert not isinstance(alloc(pool, "r", [1]), Refused)
    with pytest.raises(ValueError):
        pool.use_free_list(SlotFence(SLOTS))


# ---------------------------------------------------------------------- hypothesis


class FenceMachine(RuleBasedStateMachine):
    """Every live transaction's slots and every cached block hold only their own bytes.

    A transaction's slots are stamped with its tag when it opens (its worker writes its
    KV); a network write carries the tag of the transaction it was granted for and
    lands byte by byte between ``enter`` and ``leave``, possibly after that transaction
    was aborted or expired."""

    @initialize()
    def setup(self):
        self.clock = ManualClock()
        self.pool = BlockPool(SLOTS, BS, self.clock)
        self.gens = memoryview(bytearray(8 * SLOTS)).cast("q")  # as the store shares them
        self.fence = SlotFence(SLOTS, gens=self.gens)
        self.pool.use_free_list(self.fence)
        self.arena = [0] * SLOTS  # one "byte" per slot: the tag of whoever wrote it last
        self.txs: dict[str, tuple[int, list[int]]] = {}  # live tx -> (tag, new slots)
        self.cached: dict[int, tuple[int, int]] = {}  # hash -> (slot, tag) committed
        self.grants: list[tuple[str, int, object]] = []  # (tx, tag, grant)
        self.ops: list[tuple[int, object, bool]] = []  # (tag, op, landed)
        self.next = 1

    # -- transactions

    @rule(n=st.integers(1, 3))
    def open_tx(self, n):
        tag = self.next
        self.next += 1
        hashes = [tag * 10 + i for i in range(n)]
        a = alloc(self.pool, f"r{tag}", hashes, lease_s=5.0)
        if isinstance(a, Refused):
            return
        for s in a.slots:
            # reuse: never a slot something still moves bytes into
            assert not self.fence.writing([s])
            self.arena[s] = tag
        self.txs[a.tx_id] = (tag, list(a.slots))

    @precondition(lambda self: self.txs)
    @rule(i=st.integers(0, 50))
    def abort(self, i):
        tx = sorted(self.txs)[i % len(self.txs)]
        assert isinstance(result(self.pool.abort(tx)), TxDone)
        del self.txs[tx]

    @precondition(lambda self: self.txs)
    @rule()
    def expire_all(self):
        self.clock.advance(10.0)
        for tx in self.pool.expire():
            del self.txs[tx]

    @precondition(lambda self: self.txs)
    @rule(i=st.integers(0, 50))
    def commit(self, i):
        tx = sorted(self.txs)[i % len(self.txs)]
        tag, slots = self.txs[tx]
        if self.fence.writing(slots):
            return  # the store refuses it (busy) until the transfers closed
        assert isinstance(result(self.pool.commit(tx)), TxDone)
        del self.txs[tx]
        for k, s in enumerate(slots):
            h = tag * 10 + k
            if self.pool.slot_of(h) == s:
                self.cached[h] = (s, tag)

    # -- the network side

    @precondition(lambda self: self.txs)
    @rule(i=st.integers(0, 50))
    def grant(self, i):
        tx = sorted(self.txs)[i % len(self.txs)]
        tag, slots = self.txs[tx]
        assert self.pool.check_write(tx, slots) is None
        self.grants.append((tx, tag, self.fence.open(slots, write=True)))

    @precondition(lambda self: self.grants)
    @rule(i=st.integers(0, 50), k=st.integers(0, 2))
    def start_write(self, i, k):
        _, tag, g = self.grants[i % len(self.grants)]
        op = self.fence.enter(g.slots[k % len(g.slots) :][:1], write=True)
        if op is None:
            assert any(
                self.fence.generation(s) != gen for s, gen in zip(g.slots, g.gens, strict=True)
            )
            return
        self.ops.append((tag, op, False))

    @precondition(lambda self: self.ops)
    @rule(i=st.integers(0, 50))
    def bytes_land(self, i):
        j = i % len(self.ops)
        tag, op, _ = self.ops[j]
        for s in op.slots:
            self.arena[s] = tag  # the receiver thread's recv_into: no check here
        self.ops[j] = (tag, op, True)

    @precondition(lambda self: self.grants)
    @rule(i=st.integers(0, 50))
    def same_host_copy(self, i):
        """A peer on this host copies into the slots itself (nobody checks the write),
        then reads the generations: its verdict, without asking the store."""
        tx, tag, g = self.grants[i % len(self.grants)]
        for s in g.slots:
            self.arena[s] = tag
        verdict = unchanged(self.gens, list(g.slots), list(g.gens))
        assert verdict == (tx in self.txs)  # accepted exactly when the tx is live

    @precondition(lambda self: self.ops)
    @rule(i=st.integers(0, 50))
    def end_write(self, i):
        tag, op, landed = self.ops.pop(i % len(self.ops))
        ok = self.fence.leave(op)
        live = any(t == tag for t, _ in self.txs.values())
        if not live:
            assert not ok  # the transaction ended while the bytes moved: fenced

    @precondition(lambda self: self.grants)
    @rule(i=st.integers(0, 50))
    def close_grant(self, i):
        tx, tag, g = self.grants.pop(i % len(self.grants))
        ok = self.fence.close(g)
        if tx not in self.txs and not any(c_tag == tag for _, c_tag in self.cached.values()):
            assert not ok

    # -- readers

    @invariant()
    def readers_see_only_their_own_bytes(self):
        if not hasattr(self, "pool"):
            return
        for tag, slots in self.txs.values():
            for s in slots:
                assert self.arena[s] == tag, (s, self.arena[s], tag)
        for h, (s, tag) in list(self.cached.items()):
            if self.pool.slot_of(h) != s:
                del self.cached[h]  # evicted since
                continue
            assert self.arena[s] == tag, (h, s, self.arena[s], tag)

    @invariant()
    def every_slot_is_free_parked_or_owned(self):
        if not hasattr(self, "pool"):
            return
        s = self.pool.stats()
        assert s["free_blocks"] + s["used_blocks"] == SLOTS
        assert s["free_blocks"] == len(self.fence)


FenceMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestFenceInterleavings = FenceMachine.TestCase


# ---------------------------------------------------------------------- real sockets


class _HeldGuard(ArenaGuard):
    """Signals when a write entered, then holds the receiver thread until released."""

    def __init__(self, fence, block_bytes, capabilities=False):
        super().__init__(fence, block_bytes, capabilities)
        self.entered = threading.Event()
        self.go = threading.Event()

    def enter(self, region, offset, length, write, **kw):
        out = super().enter(region, offset, length, write, **kw)
        if out[0] is not None:
            self.entered.set()
            assert self.go.wait(30)
        return out


def test_a_tcp_write_held_across_an_abort_is_refused_and_never_reaches_a_reader():
    bb = 64 * 1024
    pool = BlockPool(4, BS, ManualClock())
    fence = SlotFence(4)
    pool.use_free_list(fence)
    arena = memoryview(bytearray(4 * bb))
    guard = _HeldGuard(fence, bb)
    guard.region = 1
    rx = TcpReceiver(guard=guard)
    rx.expose(Region(id=1, buf=arena))
    try:
        a = alloc(pool, "victim", [1, 2])
        victim = a.slots[0]
        arena[victim * bb : (victim + 1) * bb] = b"\x11" * bb
        fence.open(a.slots, write=True)  # what serving OPEN does
        host, port = rx.address.removeprefix("tcp://").rsplit(":", 1)
        sock = socket.create_connection((host, int(port)))
        sock.sendall(HELLO + REQ.pack(1, 0, 0, 1, 1, victim * bb, bb, 0, NO_TOKEN))
        assert guard.entered.wait(10)  # the receiver thread holds the slot now
        assert isinstance(result(pool.abort(a.tx_id)), TxDone)
        assert fence.parked == 2  # the grant (and the write on the first) hold both slots
        # a new transaction is never given the slot the late write lands in
        b = alloc(pool, "next", [3, 4])
        assert victim not in b.slots
        for s in b.slots:
            arena[s * bb : (s + 1) * bb] = b"\x22" * bb
        guard.go.set()
        sock.sendall(b"\x99" * bb)
        hdr = memoryview(bytearray(REP.size))
        recv_exact(sock, hdr)
        status, _, seq, n = REP.unpack(hdr)
        msg = memoryview(bytearray(n))
        recv_exact(sock, msg)
        assert (status, seq) == (Status.REFUSED, 1) and b"fenced" in bytes(msg)
        for s in b.slots:  # the reader of the new transaction sees its own bytes only
            assert bytes(arena[s * bb : (s + 1) * bb]) == b"\x22" * bb
        sock.close()
    finally:
        rx.close()


async def _planes(transports):
    ctx = zmq.asyncio.Context()
    made = []
    for _ in range(2):
        arena = Arena.create(8, 256 * 1024)
        pool = BlockPool(8, BS, ManualClock(), id_prefix=f"p{len(made)}-")
        plane = DataPlane(
            ctx,
            pool,
            arena,
            epoch=1,
            transports=transports,
            peer_timeout_s=5.0,
            clock=ManualClock().now,
        )
        made.append((plane, pool, arena))
    tasks = [asyncio.create_task(p.run()) for p, _, _ in made]
    yield made
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for plane, _, arena in made:
        await plane.close()
        arena.close()
        arena.unlink()
    ctx.destroy(linger=0)


@pytest.fixture
async def planes():
    async for made in _planes(("tcp",)):
        yield made


@pytest.fixture(params=["tcp", "shm"])
async def both_planes(request):
    """(kind, planes): a TCP-only pair, then a pair that copies through shared memory."""
    transports = ("tcp",) if request.param == "tcp" else ("shm", "tcp")
    async for made in _planes(transports):
        yield request.param, made


async def test_a_ship_whose_destination_is_aborted_mid_receive_is_fenced(planes):
    (a, pa, arena_a), (b, pb, arena_b) = planes
    bb = arena_a.block_bytes
    held = _HeldGuard(b.fence, bb, capabilities=True)
    held.region = b.guard.region
    b.engines["tcp"].receiver.guard = held
    src = alloc(pa, "r", [1, 2], role=TxRole.PREFILL)
    dst = alloc(pb, "r", [1, 2])
    for s in src.slots:
        arena_a.slot(s)[:] = b"\x5a" * bb
    ship = wire.Ship(
        id=1,
        src_tx=src.tx_id,
        src_epoch=1,
        src_slots=src.slots,
        dst_addr=b.data_addr,
        dst_tx=dst.tx_id,
        dst_epoch=1,
        dst_slots=dst.slots,
        offset=0,
        length=bb,
    )
    task = asyncio.create_task(a.ship(ship))
    assert await asyncio.to_thread(held.entered.wait, 20)
    assert b.open_grants(dst.tx_id) == 1
    assert isinstance(result(pb.abort(dst.tx_id)), TxDone)  # mid-receive
    assert b.fence.parked == len(dst.slots)
    again = alloc(pb, "r2", [7, 8, 9])  # reuse: never the fenced slots
    assert not set(again.slots) & set(dst.slots)
    held.go.set()
    with pytest.raises(wire.WireError) as e:
        await task
    assert e.value.code == "transfer_refused" and "fenced" in str(e.value)
    assert b.open_grants(dst.tx_id) == 0 and b.fence.parked == 0
    assert b.counters["blocks_written_remote"] == 0 and a.counters["tcp_bytes"] == 0
    # the source slots were held while they were sent, and are released now
    assert not a.fence.writing(src.slots)


async def test_a_ship_into_a_live_tx_lands_and_is_counted_per_transport(planes):
    (a, pa, arena_a), (b, pb, arena_b) = planes
    bb = arena_a.block_bytes
    src = alloc(pa, "r", [1, 2, 3], role=TxRole.PREFILL)
    dst = alloc(pb, "r", [1, 2, 3])
    for i, s in enumerate(src.slots):
        arena_a.slot(s)[:] = bytes([i + 1]) * bb
    ship = wire.Ship(
        id=1,
        src_tx=src.tx_id,
        src_epoch=1,
        src_slots=src.slots,
        dst_addr=b.data_addr,
        dst_tx=dst.tx_id,
        dst_epoch=1,
        dst_slots=dst.slots,
        offset=bb // 2,
        length=bb // 2,
    )
    assert (await a.ship(ship)).nbytes == 3 * bb // 2
    for i, s in enumerate(dst.slots):
        assert bytes(arena_b.slot(s)[bb // 2 :]) == bytes([i + 1]) * (bb // 2)
        assert bytes(arena_b.slot(s)[: bb // 2]) == bytes(bb // 2)
    assert a.counters["tcp_bytes"] == 3 * bb // 2
    # over TCP the close goes out without being waited for: a commit waits for it
    assert await b.settled(dst.tx_id, timeout=10)
    assert b.open_grants(dst.tx_id) == 0 and not b.fence.writing(dst.slots)
    assert b.counters["blocks_written_remote"] == 3
    # and back: pull those whole slots into a new transaction of the first store
    back = alloc(pa, "p", [4, 5, 6])
    pull = wire.Pull(
        id=2,
        dst_tx=back.tx_id,
        dst_epoch=1,
        dst_slots=back.slots,
        src_addr=b.data_addr,
        src_tx=dst.tx_id,
        src_epoch=1,
        src_slots=dst.slots,
    )
    assert (await a.pull(pull)).nbytes == 3 * bb
    for s_b, s_a in zip(dst.slots, back.slots, strict=True):
        assert bytes(arena_a.slot(s_a)) == bytes(arena_b.slot(s_b))
    assert b.counters["blocks_read_remote"] == 3 and a.counters["bytes_in"] == 3 * bb
    assert not a.fence.writing(back.slots) and b.open_grants(dst.tx_id) == 0


async def test_a_commit_waits_for_open_grants_and_an_unclosed_grant_expires(planes):
    _, (b, pb, arena_b) = planes
    dst = alloc(pb, "r", [1, 2])
    g = b.serve_open(
        wire.Open(
            id=1,
            tx=dst.tx_id,
            epoch=1,
            slots=dst.slots,
            offset=0,
            length=arena_b.block_bytes,
            write=True,
        )
    )
    assert not await b.settled(dst.tx_id, timeout=0.01)  # the store refuses the commit (busy)
    with pytest.raises(wire.WireError):  # a CLOSE without the grant's token
        b.serve_close(wire.Close(id=2, grant=g.grant, ok=True, token=b"forged" * 3))
    assert not await b.settled(dst.tx_id, timeout=0)  # ...is refused: the grant stays
    b.serve_close(wire.Close(id=2, grant=g.grant, ok=True, token=g.token))
    assert await b.settled(dst.tx_id, timeout=0)
    # a peer that never closes: its grant ends after its ttl (injected clock), as failed
    g = b.serve_open(
        wire.Open(
            id=3, tx=dst.tx_id, epoch=1, slots=dst.slots, offset=0, length=16, write=True, pid=0
        )
    )
    assert b.expire_grants(now=b.clock() + g.ttl_s - 0.001) == []
    assert b.expire_grants(now=b.clock() + g.ttl_s) == [g.grant]
    assert b.open_grants(dst.tx_id) == 0 and not b.fence.writing(dst.slots)
    with pytest.raises(wire.WireError) as e:  # its late close is told it was fenced
        b.serve_close(wire.Close(id=4, grant=g.grant, ok=True))
    assert e.value.code == "fenced"
    with pytest.raises(wire.WireError) as e:  # a write grant on slots the tx does not own
        b.serve_open(
            wire.Open(id=5, tx=dst.tx_id, epoch=1, slots=[7], offset=0, length=16, write=True)
        )
    assert e.value.code == "forbidden"
    with pytest.raises(wire.WireError) as e:
        b.serve_open(
            wire.Open(id=6, tx=dst.tx_id, epoch=2, slots=dst.slots, offset=0, length=16, write=True)
        )
    assert e.value.code == "epoch"


# ---------------------------------------------------------------------- leases


def _ship(a, b, src, dst, half: int, bb: int, last: bool) -> wire.Ship:
    """Half ``half`` (0 or 1) of every slot, as a layer ship would send it."""
    return wire.Ship(
        id=10 + half,
        src_tx=src.tx_id,
        src_epoch=1,
        src_slots=src.slots,
        dst_addr=b.data_addr,
        dst_tx=dst.tx_id,
        dst_epoch=1,
        dst_slots=dst.slots,
        offset=half * bb // 2,
        length=bb // 2,
        last=last,
    )


def _fill(arena, slots, bb):
    for i, s in enumerate(slots):
        arena.slot(s)[:] = bytes([i + 1]) * bb


async def test_the_ships_into_a_tx_share_one_grant_which_the_last_ship_closes(both_planes):
    kind, ((a, pa, arena_a), (b, pb, arena_b)) = both_planes
    a._tcp_inline_max = 0  # TCP: once a ship connected the streams, submit from the loop
    bb = arena_a.block_bytes
    src = alloc(pa, "r", [1, 2], role=TxRole.PREFILL)
    dst = alloc(pb, "r", [1, 2])
    _fill(arena_a, src.slots, bb)
    await a.lease(
        wire.Lease(id=1, dst_addr=b.data_addr, dst_tx=dst.tx_id, dst_epoch=1, dst_slots=dst.slots)
    )
    assert b.counters["grants_served"] == 1 and b.open_grants(dst.tx_id) == 1
    assert (await a.ship(_ship(a, b, src, dst, 0, bb, last=False))).nbytes == bb
    # the grant stays open between the ships (a commit would wait for it)
    assert b.counters["grants_served"] == 1 and b.open_grants(dst.tx_id) == 1
    assert (await a.ship(_ship(a, b, src, dst, 1, bb, last=True))).nbytes == bb
    assert b.counters["grants_served"] == 1  # one OPEN for both ships
    # The OK did not wait for the CLOSE (still on its way): over TCP the receiver checked
    # each write; over shm the writer read b's slot generations after its copy.
    assert b.open_grants(dst.tx_id) == 1
    assert await b.settled(dst.tx_id, timeout=10)
    for a_s, b_s in zip(src.slots, dst.slots, strict=True):
        assert bytes(arena_b.slot(b_s)) == bytes(arena_a.slot(a_s))
    assert b.counters["writes_in"] == 1 and b.counters["bytes_in"] == 2 * bb
    assert a.counters[f"{kind}_bytes"] == 2 * bb
    assert a._tcp_warm == ({b.segments["tcp"]} if kind == "tcp" else set())
    assert not a.fence.writing(src.slots) and not b.fence.writing(dst.slots)


async def test_a_quiet_close_ends_its_grant_and_gets_no_reply(planes):
    """The last ship's CLOSE is unawaited (the OK went out already): the peer ends the
    grant without a reply that would only wake the sender. On the peer's Unix socket,
    replies come in order: the next reply is the next OPEN's."""
    _, (b, pb, _) = planes
    dst = alloc(pb, "r", [1, 2])
    reader, writer = await asyncio.open_unix_connection(b.ctl_path)

    async def reply() -> tuple[wire.Kind, object]:
        n = int.from_bytes(await asyncio.wait_for(reader.readexactly(4), 5), "little")
        frame = await reader.readexactly(n)
        return wire.parse([frame[:1], frame[1:]])

    def opening(rid: int) -> wire.Open:
        return wire.Open(
            id=rid, tx=dst.tx_id, epoch=1, slots=dst.slots, offset=0, length=64, write=True
        )

    writer.write(local_channel.encode(opening(1)))
    kind, granted = await reply()
    assert kind == wire.Kind.GRANTED and b.open_grants(dst.tx_id) == 1
    for quiet in (True, False):
        close = wire.Close(id=2, grant=granted.grant, ok=True, token=granted.token, quiet=quiet)
        writer.write(local_channel.encode(close))
        writer.write(local_channel.encode(opening(3)))
        kind, out = await reply()
        if quiet:  # no OK for the CLOSE: the first reply is the OPEN's
            assert (kind, out.id) == (wire.Kind.GRANTED, 3), out
            assert b.counters["writes_in"] == 1  # the grant ended as done
        else:  # a CLOSE that is not quiet is answered first
            assert (kind, out.id) == (wire.Kind.OK, 2), out
            assert (await reply())[0] == wire.Kind.GRANTED
        granted = out if quiet else granted
    # a quiet CLOSE of a grant it does not hold: refused without a word, the store serves on
    bad = wire.Close(id=4, grant=granted.grant, ok=True, token=b"x" * 16, quiet=True)
    writer.write(local_channel.encode(bad))
    writer.write(local_channel.encode(opening(5)))
    kind, out = await reply()
    assert (kind, out.id) == (wire.Kind.GRANTED, 5)
    writer.close()


async def test_a_grant_reused_across_ships_is_revoked_when_its_tx_aborts(both_planes):
    kind, ((a, pa, arena_a), (b, pb, arena_b)) = both_planes
    a._tcp_inline_max = 0  # TCP: once a ship connected the streams, submit from the loop
    bb = arena_a.block_bytes
    src = alloc(pa, "r", [1, 2], role=TxRole.PREFILL)
    dst = alloc(pb, "r", [1, 2])
    _fill(arena_a, src.slots, bb)
    await a.ship(_ship(a, b, src, dst, 0, bb, last=False))
    assert b.open_grants(dst.tx_id) == 1
    assert isinstance(result(pb.abort(dst.tx_id)), TxDone)  # between two ships
    assert b.fence.parked == len(dst.slots)  # the lease holds them: no one else gets them
    again = alloc(pb, "r2", [7, 8, 9])
    assert not set(again.slots) & set(dst.slots)
    with pytest.raises(wire.WireError) as e:
        await a.ship(_ship(a, b, src, dst, 1, bb, last=True))
    # TCP: the receiver refuses the write into revoked slots; shm: the bytes were copied
    # into the parked slots, whose new generations the writer reads: discarded
    assert e.value.code == ("transfer_refused" if kind == "tcp" else "fenced")
    assert ("not in slots granted" if kind == "tcp" else "discarded") in str(e.value)
    # the failed ship closed the lease: the slots are free again, nothing is counted in
    assert b.open_grants(dst.tx_id) == 0 and b.fence.parked == 0
    assert b.counters["writes_in"] == 0 and b.counters["grants_fenced"] == 1
    assert not a.fence.writing(src.slots) and a._leases == {}
    assert a._tcp_warm == set()  # a failed TCP transfer goes through a thread again
    # a ship into a new transaction opens a new grant
    fresh = alloc(pb, "r3", [4, 5])
    assert (await a.ship(_ship(a, b, src, fresh, 0, bb, last=True))).nbytes == bb
    assert b.counters["grants_served"] == 2


async def test_a_lease_opened_ahead_waits_for_its_first_ship_while_its_grant_lasts(planes):
    """A compute longer than the idle time must not cost its first ship a new OPEN; a
    lease never shipped through still ends with its grant's time."""
    (a, pa, arena_a), (b, pb, arena_b) = planes
    bb = arena_a.block_bytes
    src = alloc(pa, "r", [1, 2], role=TxRole.PREFILL)
    dst = alloc(pb, "r", [1, 2])
    await a.lease(
        wire.Lease(id=1, dst_addr=b.data_addr, dst_tx=dst.tx_id, dst_epoch=1, dst_slots=dst.slots)
    )
    [lease] = a._leases.values()
    now = time.monotonic()
    assert a.retire_leases(now=now + LEASE_IDLE_S + 1) == 0  # still computing
    assert (await a.ship(_ship(a, b, src, dst, 0, bb, last=False))).nbytes == bb
    assert b.counters["grants_served"] == 1  # the first ship took the lease opened ahead
    assert a.retire_leases(now=time.monotonic() + LEASE_IDLE_S + 1) == 1  # then idle: closed
    assert await b.settled(dst.tx_id, timeout=10)
    # Never shipped through: closed once its grant's time is out, not before.
    other = alloc(pb, "r2", [3, 4])
    await a.lease(
        wire.Lease(
            id=2, dst_addr=b.data_addr, dst_tx=other.tx_id, dst_epoch=1, dst_slots=other.slots
        )
    )
    [lease] = a._leases.values()
    assert a.retire_leases(now=lease.latest - 0.001) == 0
    assert a.retire_leases(now=lease.latest + 0.001) == 1
    assert await b.settled(other.tx_id, timeout=10)


async def test_an_idle_lease_is_closed_so_a_commit_does_not_wait_on_it(planes):
    (a, pa, arena_a), (b, pb, arena_b) = planes
    bb = arena_a.block_bytes
    src = alloc(pa, "r", [1], role=TxRole.PREFILL)
    dst = alloc(pb, "r", [1])
    await a.ship(_ship(a, b, src, dst, 0, bb, last=False))
    now = time.monotonic()
    assert a.retire_leases(now=now) == 0  # just used
    assert b.open_grants(dst.tx_id) == 1
    assert a.retire_leases(now=now + LEASE_IDLE_S + 1) == 1  # its request stopped shipping
    assert await b.settled(dst.tx_id, timeout=10)
    assert a._leases == {} and not b.fence.writing(dst.slots)
    assert isinstance(result(pb.commit(dst.tx_id)), TxDone)


async def test_an_shm_copy_into_a_tx_aborted_mid_copy_is_fenced_and_never_read(
    both_planes, monkeypatch
):
    kind, ((a, pa, arena_a), (b, pb, arena_b)) = both_planes
    if kind != "shm":
        pytest.skip("the TCP receiver's own check is the mid-receive test above")
    from services.transfer.backends import shm as shm_transport

    bb = arena_a.block_bytes
    src = alloc(pa, "r", [1, 2], role=TxRole.PREFILL)
    dst = alloc(pb, "r", [1, 2])
    _fill(arena_a, src.slots, bb)
    real_copy = shm_transport.copy
    seen = {}

    def abort_halfway(dst_view, src_view):  # one copy per slot: a half-slot ship
        half = len(dst_view) // 2
        real_copy(dst_view[:half], src_view[:half])
        if not seen:  # while the bytes of the first slot move
            assert isinstance(result(pb.abort(dst.tx_id)), TxDone)
            seen["parked"] = b.fence.parked
            seen["again"] = alloc(pb, "r2", [7, 8, 9])  # reuse: never the slots written
        real_copy(dst_view[half:], src_view[half:])

    monkeypatch.setattr(shm_transport, "copy", abort_halfway)
    with pytest.raises(wire.WireError) as e:
        await a.ship(_ship(a, b, src, dst, 0, bb, last=False))
    assert e.value.code == "fenced" and "discarded" in str(e.value), str(e.value)
    assert seen["parked"] == len(dst.slots)
    assert not set(seen["again"].slots) & set(dst.slots)
    for s in seen["again"].slots:  # the new transaction's slots got none of the bytes
        assert bytes(arena_b.slot(s)) == bytes(bb)
    # the ship closed its grant as failed: the parked slots are free again
    assert b.open_grants(dst.tx_id) == 0 and b.fence.parked == 0
    assert b.counters["grants_fenced"] == 1 and b.counters["writes_in"] == 0
    assert a._leases == {} and not a.fence.writing(src.slots)


async def test_a_peer_that_shares_no_generations_gives_its_verdict_in_the_close(
    both_planes, monkeypatch
):
    kind, ((a, pa, arena_a), (b, pb, arena_b)) = both_planes
    if kind != "shm":
        pytest.skip("over TCP the receiver's acks are the verdict")
    monkeypatch.setattr(b, "own_gens", None)  # an older store: GRANTED names no generations
    bb = arena_a.block_bytes
    src = alloc(pa, "r", [1, 2], role=TxRole.PREFILL)
    dst = alloc(pb, "r", [1, 2])
    _fill(arena_a, src.slots, bb)
    assert (await a.ship(_ship(a, b, src, dst, 0, bb, last=True))).nbytes == bb
    assert b.open_grants(dst.tx_id) == 0  # the OK waited for the CLOSE verdict
    assert b.counters["writes_in"] == 1
