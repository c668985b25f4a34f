"""Object put/get over plain TCP: the store's low-latency endpoint for small objects.

A ZeroMQ request/reply crosses ZeroMQ's I/O thread twice on each side; on a busy host
those hand-offs cost more than the work. This endpoint is one asyncio (uvloop)
protocol on a plain TCP socket: a request is parsed and answered inside
``data_received``, in the same synchronous step as the pool work.

Frames (both directions, :mod:`services.transfer.object_frames`): ``u32 length`` (of
what follows), ``u8 kind``, ``u16 header length``, the msgpack header, then the payload
bytes. It is the only way an object's value enters or leaves a store from a client; the
ZeroMQ data plane carries no payload. Requests on a connection are answered in order. A
frame that does not parse gets an ERR reply.

Who may speak (a stranger may reach the port): a connection opens with an object HELLO
(:func:`services.transfer.data_auth.obj_hello`: a session id and a MAC under the run's data
key, bound to this server's address, each accepted once), sent with the first request
(no round trip). Until it checked out nothing is parsed and nothing is sent; a bad one,
or none within ``hello_timeout_s``, closes the connection without a byte in reply.

Bounds: at most ``max_pending`` connections wait for their HELLO (a new one evicts the
oldest) and at most ``max_conns`` are served. A served connection may sit idle between
requests, but one whose frame stops arriving for ``io_timeout_s`` (found by a sweep of
that period: within twice that), or whose peer stops reading its replies as long, is
closed; while replies are backed up nothing more is read from it. A length over
``max_frame`` closes the connection before anything is allocated.
"""

import asyncio
import socket
from collections import OrderedDict
from typing import Any

import structlog

from services.transfer import data_auth, wire
from services.transfer.object_frames import MAX_FRAME, decode, encode

log = structlog.get_logger()

SCRATCH = 256 * 1024


class _Protocol(asyncio.BufferedProtocol):
    """Reads into a scratch buffer and answers every complete frame in it; a frame
    larger than the scratch is read straight into its own buffer (one copy less for big
    values). Handling is synchronous, so a frame's bytes are used up before the
    scratch is reused."""

    def __init__(self, srv: "ObjectServer") -> None:
        self.srv = srv
        self.objects = srv.objects
        self.transport: Any = None  # asyncio.Transport (uvloop's is not a subclass)
        self._scratch = memoryview(bytearray(SCRATCH))
        self._have = 0
        self._big: memoryview | None = None
        self._big_got = 0
        self.authed = False
        self.closed = False
        self.paused = False  # its replies are backed up: nothing more is read
        self.rx = 0  # bytes received: the sweep's sign of progress
        self.seen_rx = 0
        self.seen_wbuf = -1
        self._hello_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        self._hello_timer = asyncio.get_running_loop().call_later(
            self.srv.hello_timeout_s, self._hello_late
        )
        self.srv._admit(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        self.srv._gone(self)

    def drop(self, why: str) -> None:
        """Close at once, nothing more sent (``why``: the counter it adds to)."""
        self.srv.counters["obj_" + why] += 1
        if not self.closed:
            self.closed = True
            self.transport.abort()

    def _hello_late(self) -> None:
        if not self.authed:
            self.drop("hello_timeouts")

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._big is not None:
            return self._big[self._big_got :]
        return self._scratch[self._have :]

    def buffer_updated(self, nbytes: int) -> None:
        self.rx += nbytes
        if self._big is not None:
            self._big_got += nbytes
            if self._big_got == len(self._big):
                frame, self._big = self._big, None
                self.transport.write(self.handle(frame))
            return
        self._have += nbytes
        if not self.authed:
            n = data_auth.OBJ_HELLO_BYTES
            if self._have < n:
                return
            if not data_auth.check_obj_hello(self.srv.macs, self.srv.addr, self._scratch[:n]):
                self._have = 0
                self.drop("bad_hellos")
                return
            if self._hello_timer is not None:
                self._hello_timer.cancel()
            self.authed = True
            if not self.srv._serve(self):
                self._have = 0
                self.drop("refused_conns")
                return
            rest = self._have - n
            self._scratch[:rest] = self._scratch[n : self._have]
            self._have = rest
        self._process()

    def _process(self) -> None:
        sv, off = self._scratch, 0
        while not self.paused and not self.closed and self._have - off >= 4:
            n = int.from_bytes(sv[off : off + 4], "little")
            if n > self.srv.max_frame:
                log.warning("object_frame_too_large", bytes=n)
                self._have = 0
                self.drop("dropped_frames")
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

    def pause_writing(self) -> None:
        self.paused = True
        try:
            self.transport.pause_reading()
        except Exception:  # noqa: BLE001 - closing already
            pass

    def resume_writing(self) -> None:
        self.paused = False
        self._process()  # what arrived before the pause (may pause again)
        if not self.paused and not self.closed:
            try:
                self.transport.resume_reading()
            except Exception:  # noqa: BLE001 - closing already
                pass

    def stalled(self) -> bool:
        """Whether it made no progress since the last sweep while it should have: a frame
        begun and not finished, or replies backed up and not read."""
        if self.paused:
            wbuf = self.transport.get_write_buffer_size()
            stuck = wbuf == self.seen_wbuf
            self.seen_wbuf = wbuf
        else:
            self.seen_wbuf = -1
            stuck = (self._have > 0 or self._big is not None) and self.rx == self.seen_rx
        self.seen_rx = self.rx
        return stuck

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
    """Serves ``objects`` (an ObjectService) on a TCP port until closed, to holders of
    ``key`` (the run's data key, :func:`services.transfer.data_auth.data_key` by default)."""

    def __init__(
        self,
        objects: Any,
        key: bytes | None = None,
        *,
        max_conns: int = 1024,
        max_pending: int = 64,
        hello_timeout_s: float = 5.0,
        io_timeout_s: float = 30.0,
        max_frame: int = MAX_FRAME,
    ) -> None:
        self.objects = objects
        self.macs = data_auth.Macs(key or data_auth.data_key())
        self.max_conns = max(1, max_conns)
        self.max_pending = max(1, max_pending)
        self.hello_timeout_s = hello_timeout_s
        self.io_timeout_s = io_timeout_s
        self.max_frame = max_frame
        self.server: asyncio.AbstractServer | None = None
        self.addr = ""
        self._pending: OrderedDict[_Protocol, None] = OrderedDict()
        self._conns: set[_Protocol] = set()
        self._sweeper: asyncio.Task | None = None
        self.counters = {
            "obj_conns": 0,
            "obj_bad_hellos": 0,
            "obj_hello_timeouts": 0,
            "obj_evicted_pending": 0,
            "obj_refused_conns": 0,
            "obj_dropped_frames": 0,
            "obj_stalled": 0,
        }

    @property
    def open_conns(self) -> tuple[int, int]:
        """(connections served, connections waiting for their HELLO)."""
        return len(self._conns), len(self._pending)

    def _admit(self, p: _Protocol) -> None:
        if len(self._pending) >= self.max_pending:
            oldest, _ = self._pending.popitem(last=False)
            oldest.drop("evicted_pending")
        self._pending[p] = None

    def _serve(self, p: _Protocol) -> bool:
        self._pending.pop(p, None)
        if len(self._conns) >= self.max_conns:
            return False
        self._conns.add(p)
        self.counters["obj_conns"] += 1
        return True

    def _gone(self, p: _Protocol) -> None:
        self._pending.pop(p, None)
        self._conns.discard(p)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.io_timeout_s)
            for p in [p for p in self._conns if p.stalled()]:
                log.info("object_connection_stalled", timeout_s=self.io_timeout_s)
                p.drop("stalled")

    async def start(self, host: str, advertise_host: str | None = None, port: int = 0) -> str:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: _Protocol(self), host, port)
        bound = self.server.sockets[0].getsockname()[1]
        self.addr = f"tcp://{advertise_host or host}:{bound}"
        self._sweeper = loop.create_task(self._sweep(), name="store:object-sweep")
        return self.addr

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self.server is not None:
            self.server.close()
        for p in [*self._pending, *self._conns]:
            if not p.closed:
                p.closed = True
                p.transport.abort()
        if self.server is not None:
            await self.server.wait_closed()
