"""A worker's requests to its own node's store over a Unix socket, without ZeroMQ; and a
same-host peer store's OPEN / CLOSE (``channel.PeerPool``'s ``local_path``).

A worker and its store share a host (the worker maps the store's arena), so the
worker's SHIP / PULL / LEASE and the store's OK / ERR need not take ZeroMQ, whose I/O
thread on each side adds two thread wake-ups to every round trip: ~0.3 ms on this VM
against ~0.02 ms for a Unix socket between two event loops, paid once per KV ship.

Frames are :mod:`services.transfer.wire`'s without payload, each prefixed by its length:
``[u32 little-endian n][kind byte][msgpack header]`` (n counts the kind byte too). The
store listens on ``StoreInfo.ctl_path``, a socket file beside its arena in /dev/shm:
whoever can map the arena (same host, compose's ``ipc: service:``, a pod's shared
/dev/shm) can reach it. A worker that cannot connect keeps the ZeroMQ channel.

Lifecycle: the store's :class:`LocalServer` binds in its constructor (a worker may
connect before the event loop accepts: the kernel queues it), serves from ``start()``
and removes the socket file on ``close()``. A frame that does not parse gets an ERR
reply (with its id when the header still gives one); a length above ``MAX_FRAME``
closes that connection. Either way the store goes on serving. :class:`LocalChannel`
is :class:`~services.transfer.channel.Channel`'s twin on the worker's side.
"""

import asyncio
import os
import socket
import struct
from collections.abc import Callable
from typing import Any, cast

import structlog

from services.transfer import wire
from services.transfer.requests import ChannelError, Requests

log = structlog.get_logger()

MAX_FRAME = 1 << 20  # a header names slots: a few KiB even for a 4k-token prompt
_LEN = struct.Struct("<I")

# What the store does with a request: (kind, header, reply) -> None; ``reply`` sends
# one answer on the connection the request came from (dropped if it closed).
Handler = Callable[[wire.Kind, Any, Callable[[Any], None]], None]


def encode(header: Any) -> bytes:
    kind, body = wire.frames(header)
    out: bytes = _LEN.pack(len(body) + 1) + kind + body
    return out


class _Frames:
    """Cuts a byte stream into frames; ``None`` from ``feed`` means over-long (close)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes] | None:
        self._buf += data
        out = []
        while len(self._buf) >= _LEN.size:
            (n,) = _LEN.unpack_from(self._buf)
            if n > MAX_FRAME:
                return None
            if len(self._buf) < _LEN.size + n:
                break
            out.append(bytes(self._buf[_LEN.size : _LEN.size + n]))
            del self._buf[: _LEN.size + n]
        return out


def _parse(frame: bytes) -> tuple[wire.Kind, Any]:
    if len(frame) < 2:
        raise wire.WireError(f"a frame of {len(frame)} bytes has no header")
    return wire.parse([frame[:1], frame[1:]])


class _ServerConn(asyncio.Protocol):
    def __init__(self, handle: Handler) -> None:
        self._handle = handle
        self._frames = _Frames()
        self._t: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._t = cast(asyncio.Transport, transport)  # uvloop's is no subclass of it

    def connection_lost(self, exc: Exception | None) -> None:
        self._t = None

    def _reply(self, header: Any) -> None:
        if self._t is not None and not self._t.is_closing():
            self._t.write(encode(header))

    def data_received(self, data: bytes) -> None:
        frames = self._frames.feed(data)
        if frames is None:
            log.warning("local_frame_too_long", max_bytes=MAX_FRAME)
            if self._t is not None:
                self._t.close()
            return
        for frame in frames:
            try:
                kind, header = _parse(frame)
            except wire.WireError as e:
                log.warning("local_request_refused", code=e.code, error=str(e))
                self._reply(wire.Err(id=e.req_id, code=e.code, message=str(e)))
                continue
            self._handle(kind, header, self._reply)


class LocalServer:
    """The store's end of its workers' Unix socket: reads their requests, writes replies."""

    def __init__(self, path: str, handle: Handler) -> None:
        self.path = path
        self._handle = handle
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            os.unlink(path)  # a dead store of the same name left it
        except FileNotFoundError:
            pass
        self._sock.bind(path)
        self._sock.listen(128)
        self._sock.setblocking(False)
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(
            lambda: _ServerConn(self._handle), sock=self._sock
        )

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        else:
            self._sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class LocalChannel(Requests, asyncio.Protocol):
    """Request/reply to the store at ``path``, many requests in flight at once."""

    def __init__(self, path: str) -> None:
        super().__init__(f"unix:{path}")
        self._frames = _Frames()
        self._t: asyncio.Transport | None = None

    @classmethod
    async def connect(cls, path: str) -> "LocalChannel":
        """Raises OSError when nothing listens at ``path`` (no store, or not shared)."""
        loop = asyncio.get_running_loop()
        _, ch = await loop.create_unix_connection(lambda: cls(path), path)
        return ch

    async def _send(self, header: Any) -> None:
        if self._t is None:
            raise ChannelError("closed", f"channel to {self.addr} is closed")
        self._t.write(encode(header))

    # -- protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._t = cast(asyncio.Transport, transport)  # uvloop's is no subclass of it

    def data_received(self, data: bytes) -> None:
        frames = self._frames.feed(data)
        if frames is None:
            log.warning("bad_reply", addr=self.addr, error="frame too long")
            self.close()
            return
        for frame in frames:
            try:
                kind, header = _parse(frame)
            except wire.WireError as e:
                log.warning("bad_reply", addr=self.addr, error=str(e))
                continue
            self._deliver(kind, header)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._t = None
        self._fail_all()

    def close(self) -> None:
        if self._closed and self._t is None:
            return
        self._closed = True
        if self._t is not None:
            self._t.close()
        self._fail_all()

    async def aclose(self) -> None:
        self.close()
