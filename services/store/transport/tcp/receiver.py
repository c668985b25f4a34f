"""TCP target: accepts streams and serves READ/WRITE on the exposed regions.

Lifecycle: ``TcpReceiver(host, port)`` binds and starts an accept thread; every
accepted stream gets its own thread that loops request -> reply until the peer
closes. A WRITE lands straight in the region (``recv_into`` the region's bytes, no
intermediate copy) unless it carries a checksum: then it lands in a scratch buffer
and is copied in only when the checksum matches, so a corrupted write is refused
without touching the region. A request for a span outside its region is refused
(its payload drained so the stream stays in step) and the stream goes on.

An optional ``guard`` (the store's :class:`~services.store.fence.ArenaGuard`) is asked
before any byte of a request moves (``enter``: refused unless its slots are under a
live grant) and after (``leave``: a WRITE whose slots were freed meanwhile is answered
REFUSED, fenced, instead of OK). While a request is between the two its slots are
held, so a late write never lands in a slot that was handed out again.
"""

import socket
import threading
from typing import Any

import structlog

from services.store.transport.base import Receiver, Region, check_span, crc32
from services.store.transport.tcp import frames
from services.store.transport.tcp.frames import FLAG_CRC, REP, REQ, Status

log = structlog.get_logger()


class TcpReceiver(Receiver):
    scheme = "tcp"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        io_timeout_s: float | None = None,
        guard: Any = None,
    ) -> None:
        self.guard = guard
        self._regions: dict[int, Region] = {}
        self._lsock = socket.create_server((host, port), backlog=128, reuse_port=False)
        self._port = self._lsock.getsockname()[1]
        self._host = advertise_host or host
        self._io_timeout = io_timeout_s
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.counters = {
            "streams": 0,
            "writes": 0,
            "reads": 0,
            "bytes_in": 0,
            "bytes_out": 0,
            "refused": 0,
            "checksum_mismatches": 0,
        }
        self._acceptor = threading.Thread(target=self._accept, name="tcp-recv-accept", daemon=True)
        self._acceptor.start()

    @property
    def address(self) -> str:
        return f"tcp://{self._host}:{self._port}"

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
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # ------------------------------------------------------------------ threads

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._lsock.accept()
            except OSError:
                return
            frames.tune(conn)
            conn.settimeout(self._io_timeout)
            with self._lock:
                self._conns.add(conn)
                self.counters["streams"] += 1
            threading.Thread(
                target=self._serve, args=(conn,), name="tcp-recv-stream", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        hdr = memoryview(bytearray(REQ.size))
        scratch: memoryview | None = None
        try:
            hello = memoryview(bytearray(len(frames.HELLO)))
            frames.recv_exact(conn, hello)
            if bytes(hello) != frames.HELLO:
                return
            while True:
                frames.recv_exact(conn, hdr)
                op, flags, _, region_id, seq, offset, length, crc = REQ.unpack(hdr)
                region = self._regions.get(region_id)
                why = (
                    f"no region {region_id}"
                    if region is None
                    else check_span(region, offset, length)
                )
                held = None
                if why is None and self.guard is not None and op in (0, 1):
                    held, why = self.guard.enter(region_id, offset, length, op == 1)
                if op == 1:  # WRITE
                    if why is not None:
                        scratch = scratch or memoryview(bytearray(1 << 20))
                        frames.discard(conn, length, scratch)
                        self._refuse(conn, seq, why)
                        continue
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
                elif op == 0:  # READ
                    if why is not None:
                        self._refuse(conn, seq, why)
                        continue
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
                else:
                    return  # out of step: drop the stream
        except (OSError, ConnectionError):
            pass
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

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
