"""A stranger (and a peer without the grant) on the data ports of real store processes:
every case gets a refusal or a clear error while an honest ship beside it lands."""

import asyncio
import secrets
import select
import socket
import threading

import msgspec
import pytest

from bus_schemas import subjects
from bus_schemas.codec import encode as encode_msg
from bus_schemas.control import TxDone, TxHandle, TxRole
from bus_schemas.load import WorkerStats
from perigee.natsd import free_port
from services.common.bus import request
from services.store.client.object_client import SyncObjectClient
from services.store.client.store_client import TransferError
from services.store.node.object_server import MAX_FRAME, encode
from services.transfer import data_auth, wire
from services.transfer.backends.contract import Opcode, Request
from services.transfer.backends.tcp import TcpSender
from services.transfer.backends.tcp.frames import NO_TOKEN, REP, REQ, Status, recv_exact
from services.transfer.backends.tcp.sender import parse_addr
from tests.security.conftest import Dealer
from tests.unit.store.test_store_integration import BB, BS, commit, fill, tx

pytestmark = pytest.mark.timeout(120)


def stream(addr: str, key: bytes | None) -> socket.socket:
    """A TCP transfer stream to ``addr``; ``key`` None: a stranger's HELLO."""
    s = socket.create_connection(parse_addr(addr), timeout=10)
    session = secrets.token_bytes(data_auth.SESSION_BYTES)
    s.sendall(data_auth.hello(key if key is not None else secrets.token_bytes(32), session))
    return s


def dropped(s: socket.socket) -> bool:
    """Whether the store closed the stream (EOF or reset), waiting for it."""
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def write(s: socket.socket, region: int, offset: int, data: bytes, token: bytes):
    s.sendall(REQ.pack(1, 0, 0, region, 1, offset, len(data), 0, token) + data)
    hdr = memoryview(bytearray(REP.size))
    recv_exact(s, hdr)
    status, _, _, n = REP.unpack(hdr)
    msg = memoryview(bytearray(n if status == Status.REFUSED else 0))
    recv_exact(s, msg)
    return status, bytes(msg)


def grant(addr: str, h: TxHandle, write: bool = True, **kw) -> wire.Granted:
    d = Dealer(addr, None)
    try:
        opened = wire.Open(
            id=data_auth.new_id(),
            tx=h.tx_id,
            epoch=h.epoch,
            slots=h.slots,
            offset=0,
            length=BB,
            write=write,
            **kw,
        )
        kind, g = d.ask(opened)
    finally:
        d.close()
    assert kind == wire.Kind.GRANTED, g
    assert isinstance(g, wire.Granted)
    return g


async def honest_ship(nc, a, b, seed: int) -> None:
    """The traffic beside every hostile case: a ship ha -> hb over TCP, bytes checked."""
    src = await tx(nc, "ha", TxRole.PREFILL, [seed], BS)
    dst = await tx(nc, "hb", TxRole.DECODE, [seed], BS)
    data = fill(a, src, seed=seed % 200)
    await a.ship_layer(src, dst, 0, [0], BB, 0)
    assert bytes(b.slot(dst.slots[0])) == data[0]
    assert isinstance(await commit(nc, "hb", dst), TxDone)


async def stats(nc, node: str) -> dict[str, int]:
    return (await request(nc, subjects.worker_stats("store", node), {}, WorkerStats)).counters


async def test_a_write_without_the_grants_token_or_on_another_session_is_refused(env):
    nc, a, b = env
    dst = await tx(nc, "hb", TxRole.DECODE, [11, 12], 2 * BS)
    other = await tx(nc, "hb", TxRole.DECODE, [13], BS)
    g = grant(b.info.data_addr, dst)
    seg, region = g.segments["tcp"], g.regions["tcp"]
    key = data_auth.data_key()
    slot0 = dst.slots[0] * BB
    mine = stream(seg, key)
    try:
        for token in (NO_TOKEN, secrets.token_bytes(16)):  # absent, forged
            status, msg = write(mine, region, slot0, b"\x66" * BB, token)
            assert (status, msg) == (Status.REFUSED, b"not authorized")
        # the grant's token on a slot outside the grant (live under nobody's grant here)
        status, _ = write(mine, region, other.slots[0] * BB, b"\x66" * BB, g.token)
        assert status == Status.REFUSED
        status, _ = write(mine, region, slot0, b"\x77" * BB, g.token)  # the holder
        assert status == Status.OK
        theirs = stream(seg, key)  # another session presenting the same token
        try:
            status, _ = write(theirs, region, slot0, b"\x66" * BB, g.token)
            assert status == Status.REFUSED
        finally:
            theirs.close()
        # a read with a write grant's token
        mine.sendall(REQ.pack(0, 0, 0, region, 2, slot0, BB, 0, g.token))
        hdr = memoryview(bytearray(REP.size))
        recv_exact(mine, hdr)
        assert REP.unpack(hdr)[0] == Status.REFUSED
        recv_exact(mine, memoryview(bytearray(REP.unpack(hdr)[3])))
    finally:
        mine.close()
    assert bytes(b.slot(dst.slots[0])) == b"\x77" * BB
    # a CLOSE without the token is refused as if the grant did not exist
    d = Dealer(b.info.data_addr, None)
    try:
        kind, err = d.ask(wire.Close(id=data_auth.new_id(), grant=g.grant, ok=True))
        assert kind == wire.Kind.ERR and err.code == "fenced"
        kind, ok = d.ask(wire.Close(id=data_auth.new_id(), grant=g.grant, ok=True, token=g.token))
        assert kind == wire.Kind.OK
    finally:
        d.close()
    # a stranger's stream (no key): dropped after its HELLO, nothing written
    s = stream(seg, None)
    s.sendall(REQ.pack(1, 0, 0, region, 1, slot0, 4, 0, g.token) + b"evil")
    assert dropped(s)
    s.close()
    assert (await stats(nc, "hb"))["tcp_rx_bad_hellos"] >= 1
    await honest_ship(nc, a, b, 1001)


async def test_a_replayed_hello_opens_no_stream(env):
    """A HELLO captured on the wire (say, from the holder's stream) opens nothing a
    second time, within its window too: the receiver remembers each one it accepted."""
    nc, a, b = env
    dst = await tx(nc, "hb", TxRole.DECODE, [21], BS)
    g = grant(b.info.data_addr, dst)
    seg, region = g.segments["tcp"], g.regions["tcp"]
    hello = data_auth.hello(data_auth.data_key(), secrets.token_bytes(data_auth.SESSION_BYTES))
    bad_before = (await stats(nc, "hb"))["tcp_rx_bad_hellos"]
    first = socket.create_connection(parse_addr(seg), timeout=10)
    replay = socket.create_connection(parse_addr(seg), timeout=10)
    try:
        first.sendall(hello)
        status, _ = write(first, region, dst.slots[0] * BB, b"\x55" * BB, g.token)
        assert status == Status.OK  # the holder's stream
        replay.sendall(hello)
        replay.sendall(REQ.pack(1, 0, 0, region, 1, dst.slots[0] * BB, 4, 0, g.token) + b"evil")
        assert dropped(replay)
    finally:
        first.close()
        replay.close()
    assert bytes(b.slot(dst.slots[0])) == b"\x55" * BB
    assert (await stats(nc, "hb"))["tcp_rx_bad_hellos"] == bad_before + 1
    await honest_ship(nc, a, b, 1011)


async def test_unsigned_router_messages_get_no_reply_and_errors_reveal_no_epoch(env):
    nc, a, b = env
    d = Dealer(b.info.data_addr, None)
    try:
        bogus = wire.Open(
            id=data_auth.new_id(), tx="x", epoch=1, slots=[0], offset=0, length=BB, write=True
        )
        d.send(wire.frames(bogus))  # a stranger's: dropped, unanswered
        d.send([*wire.frames(bogus), secrets.token_bytes(data_auth.MAC_BYTES)])  # forged MAC
        kind, err = d.ask(bogus)  # the first reply that comes is the signed one's
        assert kind == wire.Kind.ERR and err.id == bogus.id and err.code == "epoch"
        assert str(b.info.epoch) not in err.message
        # a replayed signed message is dropped too
        parts = wire.frames(bogus, data_auth.Macs(data_auth.data_key()))
        d.send(parts)
        d.send(parts)
        again = wire.Open(**{**{f: getattr(bogus, f) for f in bogus.__struct_fields__}, "id": 5})
        kind, err = d.ask(again)
        first = wire.parse(d.sock.recv_multipart(), data_auth.Macs(data_auth.data_key()))
        assert {err.id, first[1].id} == {bogus.id, 5}  # one reply each, the replay none
    finally:
        d.close()
    assert (await stats(nc, "hb"))["unauthenticated"] >= 3
    await honest_ship(nc, a, b, 1002)


async def test_a_pid_1_same_host_open_does_not_keep_its_grant_past_the_ttl(env):
    nc, a, b = env
    dst = await tx(nc, "hb", TxRole.DECODE, [21], BS)
    before = (await stats(nc, "hb"))["grants_expired"]
    g = grant(b.info.data_addr, dst, pid=1, origin=b.info.shm_name)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60  # ttl ~2 s, one more for a same-host writer
    while (await stats(nc, "hb"))["grants_expired"] == before:
        assert loop.time() < deadline, "the grant never expired"
        await asyncio.sleep(0.2)
    d = Dealer(b.info.data_addr, None)
    try:  # its holder's late CLOSE: fenced (the grant is gone)
        kind, err = d.ask(wire.Close(id=data_auth.new_id(), grant=g.grant, ok=True, token=g.token))
        assert kind == wire.Kind.ERR and err.code == "fenced"
    finally:
        d.close()
    assert isinstance(await commit(nc, "hb", dst), TxDone)  # nothing holds its slots
    await honest_ship(nc, a, b, 1003)


async def test_ship_pull_and_lease_to_an_address_no_store_announced_are_refused(env):
    nc, a, b = env
    src = await tx(nc, "ha", TxRole.PREFILL, [31], BS)
    fake = TxHandle(
        tx_id="x",
        node="hb",
        epoch=b.info.epoch,
        slots=[0],
        hit_blocks=0,
        shm_name="",
        data_addr=f"tcp://127.0.0.1:{free_port()}",
        block_bytes=BB,
    )
    assert (await stats(nc, "ha"))["known_stores"] >= 2
    for op in (
        a.ship_layer(src, fake, 0, [0], BB, 0),
        a.lease(src, fake, [0]),
    ):
        with pytest.raises(TransferError) as e:
            await op
        assert e.value.code == "unknown_peer"
    await honest_ship(nc, a, b, 1004)


async def test_an_announce_on_another_nodes_subject_teaches_the_registry_nothing(env):
    """A StoreInfo claiming hb at an address of the sender's choosing, on a subject that
    is not hb's own (what another store's login could publish): the stores drop it, so
    a ship to that address stays refused."""
    nc, a, b = env
    src = await tx(nc, "ha", TxRole.PREFILL, [33], BS)
    addr = f"tcp://127.0.0.1:{free_port()}"
    claim = msgspec.structs.replace(b.info, data_addr=addr)
    await nc.publish(subjects.store_announce("hx"), encode_msg(claim))
    await nc.flush()
    fake = TxHandle(
        tx_id="x",
        node="hb",
        epoch=b.info.epoch,
        slots=[0],
        hit_blocks=0,
        shm_name="",
        data_addr=addr,
        block_bytes=BB,
    )
    with pytest.raises(TransferError) as e:
        await a.ship_layer(src, fake, 0, [0], BB, 0)
    assert e.value.code == "unknown_peer"
    await honest_ship(nc, a, b, 1008)  # hb's real address is still known


async def test_an_oversize_length_drops_the_stream_without_allocating(env):
    nc, a, b = env
    dst = await tx(nc, "hb", TxRole.DECODE, [41], BS)
    g = grant(b.info.data_addr, dst)
    s = stream(g.segments["tcp"], data_auth.data_key())
    s.sendall(REQ.pack(1, 0, 0, g.regions["tcp"], 1, 0, 1 << 62, 0, g.token))
    assert dropped(s)  # nothing drained or allocated
    s.close()
    await honest_ship(nc, a, b, 1005)


def test_a_refusal_length_is_checked_before_it_is_allocated():
    """A target answering REFUSED with a huge length: the stream breaks, no allocation."""
    lsock = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = lsock.accept()
        recv_exact(conn, memoryview(bytearray(data_auth.HELLO_BYTES)))
        hdr = memoryview(bytearray(REQ.size))
        recv_exact(conn, hdr)
        seq = REQ.unpack(hdr)[4]
        conn.sendall(REP.pack(Status.REFUSED, 0, seq, 1 << 60))
        conn.recv(1)
        conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    sender = TcpSender(streams=1)
    try:
        target = f"tcp://127.0.0.1:{lsock.getsockname()[1]}"
        ticket = sender.submit(Request(Opcode.READ, memoryview(bytearray(16)), target, 1, 0))
        ticket.wait(20)
        assert ticket.error is not None and ticket.error.code in ("broken", "unreachable")
    finally:
        sender.close()
        lsock.close()


async def test_many_idle_connections_are_bounded_and_honest_streams_still_connect(env):
    nc, a, b = env
    dst = await tx(nc, "hb", TxRole.DECODE, [51], BS)
    g = grant(b.info.data_addr, dst)
    d = Dealer(b.info.data_addr, None)
    d.ask(wire.Close(id=data_auth.new_id(), grant=g.grant, ok=True, token=g.token))
    d.close()
    idle = [socket.create_connection(parse_addr(g.segments["tcp"])) for _ in range(100)]
    try:
        # the receiver waits for at most 64 HELLOs: the oldest idle ones are dropped
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        closed: set[int] = set()
        while len(closed) < 100 - 64:
            assert loop.time() < deadline, f"only {len(closed)} idle streams dropped"
            ready, _, _ = await asyncio.to_thread(
                select.select, [s for i, s in enumerate(idle) if i not in closed], [], [], 1
            )
            for s in ready:
                if dropped(s):
                    closed.add(idle.index(s))
        await honest_ship(nc, a, b, 1006)
        assert (await stats(nc, "hb"))["tcp_rx_evicted_pending"] >= 100 - 64
    finally:
        for s in idle:
            s.close()


def obj_conn(addr: str, hello: bytes | None) -> socket.socket:
    """A connection to a store's object server that opens with ``hello`` (None: none)."""
    s = socket.create_connection(parse_addr(addr), timeout=15)
    if hello is not None:
        s.sendall(hello)
    return s


def honest_objects(addr: str, key: str) -> None:
    """The traffic beside every hostile case on the object server: a put, then a get."""
    objs = SyncObjectClient({"ha": addr}, timeout_s=10)
    try:
        value = secrets.token_bytes(3000)
        objs.put(key, value)
        assert objs.get(key) == value
    finally:
        objs.close()


async def test_the_object_server_tells_a_stranger_nothing_and_serves_holders(env):
    nc, a, _ = env
    addr = a.info.obj_addr
    put = encode(wire.Kind.OBJ_PUT, wire.ObjPut(id=1, key="stranger", size=1), [b"x"])
    get = encode(wire.Kind.OBJ_GET, wire.ObjGet(id=2, key="stranger"))
    before = await stats(nc, "ha")
    replayed = data_auth.obj_hello(data_auth.data_key(), addr)
    await asyncio.to_thread(honest_objects, addr, "before")
    first = obj_conn(addr, replayed)  # a holder's connection, its HELLO then replayed
    strangers = [
        obj_conn(addr, data_auth.obj_hello(secrets.token_bytes(32), addr)),  # another key
        obj_conn(
            addr, data_auth.obj_hello(data_auth.data_key(), "tcp://127.0.0.1:1")
        ),  # another store's
        obj_conn(addr, None),  # no HELLO: frames straight away
        obj_conn(addr, replayed),
    ]
    try:
        for s in strangers:
            s.sendall(put + get + bytes(data_auth.OBJ_HELLO_BYTES))
        for s in strangers:
            assert await asyncio.to_thread(dropped, s)  # not one byte back
        await asyncio.to_thread(honest_objects, addr, "beside")
        objs = SyncObjectClient({"ha": addr}, timeout_s=10)
        try:
            with pytest.raises(KeyError):
                objs.get("stranger")
        finally:
            objs.close()
        first.sendall(get)
        assert await asyncio.to_thread(first.recv, 4)  # the holder is answered
    finally:
        for s in [first, *strangers]:
            s.close()
    after = await stats(nc, "ha")
    assert after["obj_bad_hellos"] - before["obj_bad_hellos"] == len(strangers)


async def test_an_oversize_object_length_is_refused_without_allocating(env):
    nc, a, _ = env
    addr = a.info.obj_addr
    s = obj_conn(addr, data_auth.obj_hello(data_auth.data_key(), addr))
    try:
        s.sendall((MAX_FRAME + 1).to_bytes(4, "little") + b"\0" * 64)
        assert await asyncio.to_thread(dropped, s)  # nothing drained or allocated
    finally:
        s.close()
    assert (await stats(nc, "ha"))["obj_dropped_frames"] >= 1
    await asyncio.to_thread(honest_objects, addr, "after-oversize")
    await honest_ship(nc, a, env[2], 1007)
