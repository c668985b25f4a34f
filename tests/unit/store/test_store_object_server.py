"""The plain-TCP object endpoint: framing, big frames, pipelining, bad input, and who
may speak to it (the object HELLO under the data key, bounds, timeouts)."""

import asyncio
import secrets

import pytest

from services.store.node import object_server
from services.store.node.object_server import ObjectServer
from services.transfer import data_auth, object_frames, wire

KEY = secrets.token_bytes(32)


class Objects:
    """A stand-in ObjectService: a dict."""

    def __init__(self) -> None:
        self.kv: dict[str, bytes] = {}

    def put(self, h, payload):
        data = b"".join(bytes(p) for p in payload)
        if len(data) != h.size:
            raise wire.WireError("size mismatch", "bad_request", h.id)
        self.kv[h.key] = data
        return wire.Ok(id=h.id, nbytes=h.size), []

    def get(self, h):
        if h.key not in self.kv:
            return wire.Err(id=h.id, code="missing", message="not here"), []
        return wire.Ok(id=h.id, nbytes=len(self.kv[h.key])), [self.kv[h.key]]


async def roundtrip(reader, writer, frames: list[bytes]) -> list[tuple]:
    writer.write(b"".join(frames))
    out = []
    for _ in frames:
        n = int.from_bytes(await reader.readexactly(4), "little")
        kind, header, payload = object_frames.decode(memoryview(await reader.readexactly(n)))
        out.append((kind, header, bytes(payload)))
    return out


async def connect(addr: str, key: bytes | None = KEY, hello: bytes | None = None):
    """A connection to ``addr`` that opens with its object HELLO (``hello`` as given,
    else one under ``key``; None: no HELLO at all)."""
    host, port = addr.removeprefix("tcp://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    if hello is None and key is not None:
        hello = data_auth.obj_hello(key, addr)
    if hello is not None:
        writer.write(hello)
    return reader, writer


async def closed_silently(reader, timeout: float = 10) -> bool:
    """Whether the server closes the connection without sending a byte."""
    try:
        return await asyncio.wait_for(reader.read(), timeout) == b""
    except ConnectionResetError:
        return True


@pytest.fixture
async def endpoint():
    srv = ObjectServer(Objects(), KEY)
    addr = await srv.start("127.0.0.1")
    reader, writer = await connect(addr)
    yield srv, reader, writer
    writer.close()
    await srv.close()


async def test_pipelined_small_and_big_frames(endpoint):
    srv, reader, writer = endpoint
    big = bytes(range(256)) * (3 * object_server.SCRATCH // 256 + 7)  # bigger than the scratch
    enc = object_frames.encode
    got = await roundtrip(
        reader,
        writer,
        [
            enc(wire.Kind.OBJ_PUT, wire.ObjPut(id=1, key="a", size=3), [b"abc"]),
            enc(wire.Kind.OBJ_PUT, wire.ObjPut(id=2, key="big", size=len(big)), [big]),
            enc(wire.Kind.OBJ_GET, wire.ObjGet(id=3, key="a")),
            enc(wire.Kind.OBJ_GET, wire.ObjGet(id=4, key="big")),
            enc(wire.Kind.OBJ_GET, wire.ObjGet(id=5, key="nope")),
        ],
    )
    assert [(k, h.id) for k, h, _ in got] == [
        (wire.Kind.OK, 1),
        (wire.Kind.OK, 2),
        (wire.Kind.DATA, 3),
        (wire.Kind.DATA, 4),
        (wire.Kind.ERR, 5),
    ]
    assert got[2][2] == b"abc" and got[3][2] == big and got[4][1].code == "missing"
    assert srv.objects.kv["big"] == big


async def test_bad_frames_get_errors_and_the_connection_goes_on(endpoint):
    _, reader, writer = endpoint
    bad_kind = (3).to_bytes(4, "little") + bytes([99, 0, 0])
    bad_header = object_frames.PREFIX.pack(1 + 2 + 2, wire.Kind.OBJ_GET, 2) + b"\xc1\xc1"
    write_kind = object_frames.encode(
        wire.Kind.OPEN, wire.Open(id=7, tx="t", epoch=1, slots=[], offset=0, length=0, write=True)
    )
    wrong_size = object_frames.encode(wire.Kind.OBJ_PUT, wire.ObjPut(id=8, key="k", size=9), [b"x"])
    got = await roundtrip(reader, writer, [bad_kind, bad_header, write_kind, wrong_size])
    assert [(k, h.code) for k, h, _ in got] == [
        (wire.Kind.ERR, "bad_frame"),
        (wire.Kind.ERR, "bad_frame"),
        (wire.Kind.ERR, "bad_request"),
        (wire.Kind.ERR, "bad_request"),
    ]
    ok = await roundtrip(
        reader,
        writer,
        [object_frames.encode(wire.Kind.OBJ_PUT, wire.ObjPut(id=9, key="k", size=1), [b"x"])],
    )
    assert ok[0][0] == wire.Kind.OK


async def test_an_oversized_length_closes_the_connection(endpoint):
    _, reader, writer = endpoint
    writer.write((object_frames.MAX_FRAME + 1).to_bytes(4, "little"))
    assert await asyncio.wait_for(reader.read(), timeout=10) == b""


async def test_the_clients_links_run_requests_side_by_side_and_drop_a_poisoned_one():
    """ObjectClient's per-store links (no ZeroMQ fallback): concurrent requests open up
    to ``max_links`` connections and then reuse them; an error reply keeps its link, a
    request cancelled mid-flight closes its own (its reply may still come)."""
    from services.store.client.object_client import _LinkPool
    from services.transfer.channel import ChannelError

    objects = Objects()
    objects.kv = {f"k{i}": bytes([i]) * (1000 + i) for i in range(6)}
    srv = ObjectServer(objects, KEY)
    pool = _LinkPool(await srv.start("127.0.0.1"), max_links=3, key=KEY)
    try:
        got = await asyncio.gather(
            *(pool.request(wire.ObjGet(id=i, key=f"k{i}"), (), 5.0) for i in range(6))
        )
        assert [bytes(d[0]) for _, _, d in got] == [objects.kv[f"k{i}"] for i in range(6)]
        assert pool.opened == 3 and len(pool._idle) == 3
        with pytest.raises(ChannelError) as e:
            await pool.request(wire.ObjGet(id=7, key="nope"), (), 5.0)
        assert e.value.code == "missing" and pool.opened == 3 and len(pool._idle) == 3
    finally:
        pool.close()
        await srv.close()

    arrived = asyncio.Event()

    async def silent(reader, writer):  # reads a request, never answers
        await reader.read(1)
        arrived.set()
        await reader.read()

    mute = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = mute.sockets[0].getsockname()[1]
    pool = _LinkPool(f"tcp://127.0.0.1:{port}", max_links=1, key=KEY)
    try:
        t = asyncio.create_task(pool.request(wire.ObjGet(id=1, key="k"), (), 60.0))
        await arrived.wait()
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert pool._idle == []  # not handed to the next request
    finally:
        pool.close()
        mute.close()
        await mute.wait_closed()


async def test_a_stranger_gets_no_byte_and_a_holder_beside_it_is_served():
    srv = ObjectServer(Objects(), KEY)
    addr = await srv.start("127.0.0.1")
    get = object_frames.encode(wire.Kind.OBJ_GET, wire.ObjGet(id=1, key="a"))
    put = object_frames.encode(wire.Kind.OBJ_PUT, wire.ObjPut(id=2, key="a", size=1), [b"z"])
    try:
        honest = await connect(addr)
        cases = {
            "other key": data_auth.obj_hello(secrets.token_bytes(32), addr),
            "another server's": data_auth.obj_hello(KEY, "tcp://127.0.0.1:1"),
            "no hello, a request": put + get + bytes(data_auth.OBJ_HELLO_BYTES),
            "garbage": secrets.token_bytes(data_auth.OBJ_HELLO_BYTES),
        }
        for why, hello in cases.items():
            reader, writer = await connect(addr, hello=hello)
            writer.write(put + get)
            assert await closed_silently(reader), why
            writer.close()
        assert "a" not in srv.objects.kv
        # a HELLO seen once opens nothing more (a replay from the wire)
        hello = data_auth.obj_hello(KEY, addr)
        first = await connect(addr, hello=hello)
        again = await connect(addr, hello=hello)
        again[1].write(get)
        assert await closed_silently(again[0])
        got = await roundtrip(*first, [put])
        assert got[0][0] == wire.Kind.OK
        got = await roundtrip(*honest, [get])
        assert got[0][0] == wire.Kind.DATA and got[0][2] == b"z"
        assert srv.counters["obj_bad_hellos"] == len(cases) + 1
        for _, w in (honest, first):
            w.close()
    finally:
        await srv.close()


async def test_bounds_pending_hellos_stalls_and_oversize_lengths():
    srv = ObjectServer(
        Objects(), KEY, max_pending=4, max_conns=2, hello_timeout_s=0.5, io_timeout_s=0.3
    )
    addr = await srv.start("127.0.0.1")
    try:
        # silent connections: the oldest evicted past 4, the rest closed at the timeout
        silent = [await connect(addr, key=None) for _ in range(6)]
        for r, _ in silent:
            assert await closed_silently(r)
        assert srv.counters["obj_evicted_pending"] == 2
        assert srv.counters["obj_hello_timeouts"] == 4
        # a frame begun and not finished: closed by the sweep
        r, w = await connect(addr)
        w.write((100).to_bytes(4, "little") + b"x")
        assert await closed_silently(r)
        assert srv.counters["obj_stalled"] == 1
        # a length over the bound: closed before anything is allocated
        r, w = await connect(addr)
        w.write((0xFFFFFFFF).to_bytes(4, "little"))
        assert await closed_silently(r)
        assert srv.counters["obj_dropped_frames"] == 1
        # at most max_conns served; idle ones between requests are kept
        get = object_frames.encode(wire.Kind.OBJ_GET, wire.ObjGet(id=3, key="k"))
        served = [await connect(addr) for _ in range(2)]
        for reader, writer in served:
            assert (await roundtrip(reader, writer, [get]))[0][0] == wire.Kind.ERR
        r, w = await connect(addr)
        assert await closed_silently(r)
        assert srv.counters["obj_refused_conns"] == 1
        await asyncio.sleep(1.0)  # idle past the io timeout: still served
        for reader, writer in served:
            got = await roundtrip(reader, writer, [get])
            assert got[0][0] == wire.Kind.ERR and got[0][1].code == "missing"
    finally:
        await srv.close()


async def test_replies_a_peer_does_not_read_stop_the_reading_and_then_close_it():
    objects = Objects()
    objects.kv["big"] = b"v" * (1 << 20)
    srv = ObjectServer(objects, KEY, io_timeout_s=0.5)
    addr = await srv.start("127.0.0.1")
    try:
        reader, writer = await connect(addr)
        get = object_frames.encode(wire.Kind.OBJ_GET, wire.ObjGet(id=1, key="big"))
        writer.write(get * 2000)  # 2 GiB of replies asked for, none read
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        # Dropped as stalled, and gone with what it had not read (its connection_lost
        # runs a loop iteration after the drop counts it: wait for both).
        while srv.counters["obj_stalled"] == 0 or srv._conns:
            assert loop.time() < deadline, "a peer that reads nothing was not dropped"
            await asyncio.sleep(0.1)
        assert srv.counters["obj_stalled"] == 1
        writer.close()
    finally:
        await srv.close()
