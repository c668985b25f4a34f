"""TCP target: accepts streams and serves READ/WRITE on the exposed regions.

Lifecycle: ``TcpReceiver(host, port)`` binds and starts an accept thread; every
accepted stream gets its own thread that loops request -> reply until the peer
closes. A WRITE lands straight in the region (``recv_into`` the region's bytes, no
intermediate copy) unless it carries a checksum: then it lands in a scratch buffer
and is copied in only when the checksum matches, so a corrupted write is refused
without touching the region. A request for a span outside its region is refused
(its payload drained so the stream stays in step) and the stream goes on.

An optional ``guard`` (the store's :class:`~services.store.node.fence.ArenaGuard`) is asked
before any byte of a request moves (``enter``: refused unless its slots are under a
live grant) and after (``leave``: a WRITE whose slots were freed meanwhile is answered
REFUSED, fenced, instead of OK). While a request is between the two its slots are
held, so a late write never lands in a slot that was handed out again. The guard also
checks each request's grant token against the stream's session (see ``ArenaGuard``).

Bounds (a stranger may reach the port): a stream must send its HELLO within
``hello_timeout_s`` (with ``key``, MAC'd with it); at most ``max_pending`` streams wait
for theirs (a new one evicts the oldest) and at most ``max_conns`` are served, one thread
each. A served stream may sit idle between requests, but a request whose header or
payload stops for ``io_timeout_s`` (and a reply the peer does not read for as long)
drops the stream, as does a length above ``max_request``.
"""

import socket
import threading
from collections import OrderedDict
from typing import Any

import structlog

from services.transfer import data_auth
from services.transfer.backends.contract import Receiver, Region, check_span, crc32
from services.transfer.backends.tcp import frames
from services.transfer.backends.tcp.frames import FLAG_CRC, REP, REQ, Status

log = structlog.get_logger()

MAX_REQUEST = 256 << 20  # bytes of one request (slices are a few MiB)


class TcpReceiver(Receiver):
    """Exposes registered memory to TCP peers: serves their read and write requests."""

    scheme = "tcp"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        io_timeout_s: float | None = 30.0,
        guard: Any = None,
        key: bytes | None = None,
        max_conns: int = 1024,
        max_pending: int = 64,
        hello_timeout_s: float = 5.0,
        max_request: int = MAX_REQUEST,
    ) -> None:
        self.guard = guard
        self.key = key
        # Each stream's HELLO is accepted once (a captured one opens nothing).
        self._hellos = data_auth.Macs(key) if key is not None else None
        self.max_conns = max(1, max_conns)
        self.max_pending = max(1, max_pending)
        self.hello_timeout_s = hello_timeout_s
        self.max_request = max_request
        self._regions: dict[int, Region] = {}
        self._lsock = socket.create_server((host, port), backlog=128, reuse_port=False)
        self._port = self._lsock.getsockname()[1]
        self._host = advertise_host or host
        self._io_timeout = io_timeout_s
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self._pending: OrderedDict[socket.socket, None] = OrderedDict()
        self._lock = threading.Lock()
        self.counters = {
            "streams": 0,
            "writes": 0,
            "reads": 0,
            "bytes_in": 0,
            "bytes_out": 0,
            "refused": 0,
            "checksum_mismatches": 0,
            "bad_hellos": 0,
            "evicted_pending": 0,
            "refused_streams": 0,
            "dropped_streams": 0,
        }
        self._acceptor = threading.Thread(target=self._accept, name="tcp-recv-accept", daemon=True)
        self._acceptor.start()

    @property
    def address(self) -> str:
        return f"tcp://{self._host}:{self._port}"

    @property
    def open_streams(self) -> tuple[int, int]:
        """(streams served, streams waiting for their HELLO)."""
        with self._lock:
            return len(self._conns), len(self._pending)

    def expose(self, region: Region) -> None:
        self._regions[region.id] = region

    def withdraw(self, region_id: int) -> None:
        self._regions.pop(region_id, None)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self._lsock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._lsock.close()
        with self._lock:
            conns = [*self._conns, *self._pending]
        for c in conns:
            _shut(c)

    # ------------------------------------------------------------------ threads

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._lsock.accept()
            except OSError:
                return
            with self._lock:
                victim = None
                if len(self._pending) >= self.max_pending:
                    victim, _ = self._pending.popitem(last=False)
                    self.counters["evicted_pending"] += 1
                self._pending[conn] = None
            if victim is not None:
                _shut(victim)  # its thread sees the stream end and leaves
            threading.Thread(
                target=self._serve, args=(conn,), name="tcp-recv-stream", daemon=True
            ).start()

    def _hello(self, conn: socket.socket) -> bytes | None:
        """The stream's session id once its HELLO checked out (None: drop it)."""
        frames.set_io_timeout(conn, self.hello_timeout_s)
        raw = memoryview(bytearray(data_auth.HELLO_BYTES))
        frames.recv_exact(conn, raw)
        with self._lock:  # the replay memory is shared by every stream's thread
            session = data_auth.check_hello(self._hellos, bytes(raw))
            if self._pending.pop(conn, 0) is not None or session is None:
                # evicted meanwhile, or not a HELLO
                if session is None:
                    self.counters["bad_hellos"] += 1
                return None
            if len(self._conns) >= self.max_conns:
                self.counters["refused_streams"] += 1
                return None
            self._conns.add(conn)
            self.counters["streams"] += 1
        frames.tune(conn)
        frames.set_io_timeout(conn, self._io_timeout)
        return session

    def _serve(self, conn: socket.socket) -> None:
        hdr = memoryview(bytearray(REQ.size))
        scratch: memoryview | None = None
        try:
            session = self._hello(conn)
            if session is None:
                return
            while True:
                self._next_header(conn, hdr)
                op, flags, _, region_id, seq, offset, length, crc, token = REQ.unpack(hdr)
                if op not in (0, 1) or length > self.max_request:
                    self.counters["dropped_streams"] += 1
                    return  # out of step, or more than any request: drop the stream
                region = self._regions.get(region_id)
                why = (
                    f"no region {region_id}"
                    if region is None
                    else check_span(region, offset, length)
                )
                held = None
                if why is None and self.guard is not None:
                    held, why = self.guard.enter(
                        region_id, offset, length, op == 1, token=token, session=session
                    )
                if op == 1:  # WRITE
                    if why is not None:
                        scratch = scratch or memoryview(bytearray(1 << 20))
                        frames.discard(conn, length, scratch)
                        self._refuse(conn, seq, why)
                        continue
                    assert region is not None
                    try:
                        ok = self._land(conn, region.buf[offset : offset + length], flags, crc)
                    finally:
                        fenced = self.guard.leave(held) if held is not None else None
                    if not ok:
                        self.counters["checksum_mismatches"] += 1
                        conn.sendall(REP.pack(Status.CHECKSUM, 0, seq, 0))
                        continue
                    if fenced is not None:
                        self._refuse(conn, seq, fenced)
                        continue
                    self.counters["writes"] += 1
                    self.counters["bytes_in"] += length
                    conn.sendall(REP.pack(Status.OK, 0, seq, length))
                else:  # READ
                    if why is not None:
                        self._refuse(conn, seq, why)
                        continue
                    assert region is not None
                    try:
                        src = region.buf[offset : offset + length]
                        c = crc32(src) if flags & FLAG_CRC else 0
                        conn.sendall(REP.pack(Status.OK, c, seq, length))
                        conn.sendall(src)
                    finally:
                        if held is not None:
                            self.guard.leave(held)  # the reader's own close checks the gens
                    self.counters["reads"] += 1
                    self.counters["bytes_out"] += length
        except (OSError, ConnectionError):
            pass
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._pending.pop(conn, None)
            conn.close()

    def _next_header(self, conn: socket.socket, hdr: memoryview) -> None:
        """Receive a request header; a stream may sit idle before one (its timeout then
        only wakes us up), not stall within one."""
        got, n = 0, len(hdr)
        while got < n:
            try:
                k = conn.recv_into(hdr[got:], n - got)
            except (BlockingIOError, TimeoutError):  # SO_RCVTIMEO
                if got == 0 and not self._closed.is_set():
                    continue  # idle between requests
                raise
            if k == 0:
                raise ConnectionError("peer closed the stream")
            got += k

    @staticmethod
    def _land(conn: socket.socket, dst: memoryview, flags: int, crc: int) -> bool:
        """Receive a WRITE's payload into ``dst``; False (``dst`` untouched) on a checksum
        mismatch."""
        if flags & FLAG_CRC:
            tmp = memoryview(bytearray(len(dst)))
            frames.recv_exact(conn, tmp)
            if crc32(tmp) != crc:
                return False
            dst[:] = tmp
        else:
            frames.recv_exact(conn, dst)
        return True

    def _refuse(self, conn: socket.socket, seq: int, why: str) -> None:
        self.counters["refused"] += 1
        log.debug("transfer_refused", reason=why)
        msg = why.encode()[:1024]
        conn.sendall(REP.pack(Status.REFUSED, 0, seq, len(msg)) + msg)


def _shut(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
