"""The plain-TCP object endpoint: framing, big frames, pipelining, bad input."""

import asyncio

import pytest

from services.store import object_server, wire
from services.store.object_server import ObjectServer


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
        kind, header, payload = object_server.decode(memoryview(await reader.readexactly(n)))
        out.append((kind, header, bytes(payload)))
    return out


@pytest.fixture
async def endpoint():
    srv = ObjectServer(Objects())
    addr = await srv.start("127.0.0.1")
    host, port = addr.removeprefix("tcp://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    yield srv, reader, writer
    writer.close()
    await srv.close()


async def test_pipelined_small_and_big_frames(endpoint):
    srv, reader, writer = endpoint
    big = bytes(range(256)) * (3 * object_server.SCRATCH // 256 + 7)  # bigger than the scratch
    enc = object_server.encode
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
    bad_header = object_server.PREFIX.pack(1 + 2 + 2, wire.Kind.OBJ_GET, 2) + b"\xc1\xc1"
    write_kind = object_server.encode(
        wire.Kind.OPEN, wire.Open(id=7, tx="t", epoch=1, slots=[], offset=0, length=0, write=True)
    )
    wrong_size = object_server.encode(wire.Kind.OBJ_PUT, wire.ObjPut(id=8, key="k", size=9), [b"x"])
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
        [object_server.encode(wire.Kind.OBJ_PUT, wire.ObjPut(id=9, key="k", size=1), [b"x"])],
    )
    assert ok[0][0] == wire.Kind.OK


async def test_an_oversized_length_closes_the_connection(endpoint):
    _, reader, writer = endpoint
    writer.write((object_server.MAX_FRAME + 1).to_bytes(4, "little"))
    assert await asyncio.wait_for(reader.read(), timeout=10) == b""


async def test_the_clients_links_run_requests_side_by_side_and_drop_a_poisoned_one():
    """ObjectClient's per-store links (no ZeroMQ fallback): concurrent requests open up
    to ``max_links`` connections and then reuse them; an error reply keeps its link, a
    request cancelled mid-flight closes its own (its reply may still come)."""
    from services.store.channel import ChannelError
    from services.store.objects import _LinkPool

    objects = Objects()
    objects.kv = {f"k{i}": bytes([i]) * (1000 + i) for i in range(6)}
    srv = ObjectServer(objects)
    pool = _LinkPool(await srv.start("127.0.0.1"), max_links=3)
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
    pool = _LinkPool(f"tcp://127.0.0.1:{port}", max_links=1)
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
