"""Object put/get over plain TCP: the store's low-latency endpoint for small objects.

A ZeroMQ request/reply crosses ZeroMQ's I/O thread twice on each side; on a busy host
those hand-offs cost more than the work. This endpoint is one asyncio (uvloop)
protocol on a plain TCP socket: a request is parsed and answered inside
``data_received``, in the same synchronous step as the pool work.

Frames (both directions): ``u32 length`` (of what follows), ``u8 kind``
(:class:`services.store.wire.Kind`), ``u16 header length``, the msgpack header
(:mod:`services.store.wire`'s ObjPut / ObjGet / Ok / Err), then the payload bytes.
It is the only way an object's value enters or leaves a store from a client; the
ZeroMQ data plane carries no payload. Requests on a
connection are answered in order. A frame that does not parse gets an ERR reply; a
length over ``MAX_FRAME`` closes the connection.
"""

import asyncio
import socket
import struct
from typing import Any

import msgspec
import structlog

from services.store import wire

log = structlog.get_logger()

PREFIX = struct.Struct("<IBH")  # length, kind, header length
MAX_FRAME = 1 << 30
SCRATCH = 256 * 1024
_enc = msgspec.msgpack.Encoder()


def encode(kind: wire.Kind, header: Any, payload: list[Any] | tuple = ()) -> bytes:
    hdr = _enc.encode(header)
    n = sum(len(p) for p in payload)
    return b"".join([PREFIX.pack(1 + 2 + len(hdr) + n, kind, len(hdr)), hdr, *payload])


def decode(frame: memoryview) -> tuple[wire.Kind, Any, memoryview]:
    """``frame`` is what follows the length word."""
    if len(frame) < 3:
        raise wire.WireError("short frame")
    kind_b, hlen = frame[0], int.from_bytes(frame[1:3], "little")
    try:
        kind = wire.Kind(kind_b)
    except ValueError:
        raise wire.WireError(f"unknown frame kind {kind_b}") from None
    if 3 + hlen > len(frame):
        raise wire.WireError("header runs past the frame")
    try:
        header = msgspec.msgpack.decode(frame[3 : 3 + hlen], type=wire.HEADER_TYPES[kind])
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise wire.WireError(f"bad {kind.name} header: {e}") from None
    return kind, header, frame[3 + hlen :]


class _Protocol(asyncio.BufferedProtocol):
    """Reads into a scratch buffer and answers every complete frame in it; a frame
    larger than the scratch is read straight into its own buffer (one copy less for big
    values). Handling is synchronous, so a frame's bytes are used up before the
    scratch is reused."""

    def __init__(self, objects: Any) -> None:
        self.objects = objects
        self.transport: Any = None  # asyncio.Transport (uvloop's is not a subclass)
        self._scratch = memoryview(bytearray(SCRATCH))
        self._have = 0
        self._big: memoryview | None = None
        self._big_got = 0

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._big is not None:
            return self._big[self._big_got :]
        return self._scratch[self._have :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._big is not None:
            self._big_got += nbytes
            if self._big_got == len(self._big):
                frame, self._big = self._big, None
                self.transport.write(self.handle(frame))
            return
        self._have += nbytes
        sv, off = self._scratch, 0
        while self._have - off >= 4:
            n = int.from_bytes(sv[off : off + 4], "little")
            if n > MAX_FRAME:
                log.warning("object_frame_too_large", bytes=n)
                self.transport.close()
                self._have = 0
                return
            if self._have - off - 4 >= n:
                self.transport.write(self.handle(sv[off + 4 : off + 4 + n]))
                off += 4 + n
                continue
            if 4 + n > len(sv):  # will not fit the scratch: its own buffer
                big = memoryview(bytearray(n))
                part = self._have - off - 4
                big[:part] = sv[off + 4 : self._have]
                self._big, self._big_got = big, part
                self._have = 0
                return
            break
        if off:
            rest = self._have - off
            sv[:rest] = sv[off : self._have]
            self._have = rest

    def eof_received(self) -> bool:
        return False

    def handle(self, frame: memoryview) -> bytes:
        rid = -1
        try:
            kind, header, payload = decode(frame)
            rid = getattr(header, "id", -1)
            if kind == wire.Kind.OBJ_PUT:
                reply, out = self.objects.put(header, [payload])
            elif kind == wire.Kind.OBJ_GET:
                reply, out = self.objects.get(header)
            else:
                raise wire.WireError(f"{kind.name} is not an object request", "bad_request", rid)
        except wire.WireError as e:
            reply, out = wire.Err(id=rid, code=e.code, message=str(e)), []
        except Exception as e:  # noqa: BLE001 - one bad request must not stop the endpoint
            log.exception("object_request_failed")
            reply, out = wire.Err(id=rid, code="internal", message=f"{type(e).__name__}: {e}"), []
        kind = (
            wire.Kind.ERR
            if isinstance(reply, wire.Err)
            else (wire.Kind.DATA if out else wire.Kind.OK)
        )
        return encode(kind, reply, out)


class ObjectServer:
    """Serves ``objects`` (an ObjectService) on a TCP port until closed."""

    def __init__(self, objects: Any) -> None:
        self.objects = objects
        self.server: asyncio.AbstractServer | None = None
        self.addr = ""

    async def start(self, host: str, advertise_host: str | None = None, port: int = 0) -> str:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: _Protocol(self.objects), host, port)
        bound = self.server.sockets[0].getsockname()[1]
        self.addr = f"tcp://{advertise_host or host}:{bound}"
        return self.addr

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
