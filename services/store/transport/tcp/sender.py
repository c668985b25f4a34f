"""TCP initiator: endpoints of several parallel streams, pooled and evicted by SIEVE.

Lifecycle::

    submit(req) -> Ticket            request sliced (slicing.plan) over the endpoint's streams
      endpoint = pool[target]        made on demand: ``streams`` TCP connections, each with
                                     one thread that sends what is queued (headers + WRITE
                                     payload) and reads replies (acks + READ payload, first
                                     in first out) while nothing is
      slice -> stream queue -> in flight -> acked (Ticket.slice_done) | failed
    a stream that breaks (reset, EOF, timeout, connect refused) hands every queued and
    in-flight slice to another live stream of the endpoint; a slice that has failed on
    every stream fails its ticket (``unreachable`` when no stream ever connected, else
    ``broken``). A broken stream is replaced on the next submit to that target; an
    endpoint with no live stream is dropped from the pool (and made again next time).

Bytes are never copied in Python: WRITE payloads go out with ``sendmsg`` from the
caller's memory, READ payloads arrive with ``recv_into`` the caller's memory.
"""

import socket
import threading
from collections import deque
from dataclasses import dataclass, field

import structlog

from services.store.transport import slicing
from services.store.transport.base import (
    Opcode,
    Request,
    Sender,
    Ticket,
    TransportError,
    crc32,
)
from services.store.transport.sieve import SievePool
from services.store.transport.tcp import frames
from services.store.transport.tcp.frames import FLAG_CRC, REP, REQ, Status

log = structlog.get_logger()


def parse_addr(target: str) -> tuple[str, int]:
    if not target.startswith("tcp://"):
        raise TransportError("bad_request", f"not a tcp target: {target!r}")
    host, _, port = target[len("tcp://"):].rpartition(":")
    if not host or not port.isdigit():
        raise TransportError("bad_request", f"not host:port: {target!r}")
    return host.strip("[]"), int(port)


@dataclass(eq=False)
class _Slice:
    ticket: Ticket
    opcode: Opcode
    view: memoryview
    region: int
    offset: int
    checksum: bool
    seq: int = 0
    tried: set[int] = field(default_factory=set)


def _sendmsg_all(sock: socket.socket, bufs: list) -> None:
    bufs = [memoryview(b).cast("B") for b in bufs if len(b)]
    while bufs:
        n = sock.sendmsg(bufs)
        while n:
            if n >= len(bufs[0]):
                n -= len(bufs[0])
                bufs.pop(0)
            else:
                bufs[0] = bufs[0][n:]
                n = 0


class _Stream:
    def __init__(self, ep: "_Endpoint", index: int) -> None:
        self.ep = ep
        self.index = index
        self.sock: socket.socket | None = None
        self.broken = False
        self.connected = False
        self.error = ""
        self._cv = threading.Condition()
        self._queue: deque[_Slice] = deque()
        self._inflight: deque[_Slice] = deque()
        self._seq = 0
        threading.Thread(target=self._run, name=f"tcp-stream-{index}", daemon=True).start()

    @property
    def load(self) -> int:
        return len(self._queue) + len(self._inflight)

    def push(self, s: _Slice) -> bool:
        with self._cv:
            if self.broken:
                return False
            self._queue.append(s)
            self._cv.notify()
        return True

    # -------------------------------------------------------------- thread

    def _run(self) -> None:
        """One thread per stream: send whatever is queued, then read replies while
        nothing is (a thread per direction would cost a context switch per slice)."""
        try:
            sock = socket.create_connection(self.ep.addr, timeout=self.ep.connect_timeout_s)
            frames.tune(sock)
            sock.settimeout(self.ep.io_timeout_s)
            sock.sendall(frames.HELLO)
        except OSError as e:
            self._break(f"connect to {self.ep.target} failed: {e}")
            return
        self.sock = sock
        self.connected = True
        hdr = memoryview(bytearray(REP.size))
        try:
            while True:
                with self._cv:
                    while not self._queue and not self._inflight and not self.broken:
                        self._cv.wait()
                    if self.broken:
                        return
                    s = self._queue.popleft() if self._queue else None
                    if s is not None:
                        self._seq += 1
                        s.seq = self._seq
                        self._inflight.append(s)
                if s is not None:
                    self._send(sock, s)
                else:
                    self._reply(sock, hdr)
        except (OSError, ConnectionError, ValueError) as e:
            self._break(f"stream to {self.ep.target} broke: {e}")

    def _send(self, sock: socket.socket, s: _Slice) -> None:
        s.ticket.started()
        flags = FLAG_CRC if s.checksum else 0
        if s.opcode == Opcode.WRITE:
            crc = crc32(s.view) if s.checksum else 0
            hdr = REQ.pack(1, flags, 0, s.region, s.seq, s.offset, len(s.view), crc)
            _sendmsg_all(sock, [hdr, s.view])
        else:
            sock.sendall(REQ.pack(0, flags, 0, s.region, s.seq, s.offset, len(s.view), 0))

    def _reply(self, sock: socket.socket, hdr: memoryview) -> None:
        frames.recv_exact(sock, hdr)
        status, crc, seq, length = REP.unpack(hdr)
        with self._cv:
            s = self._inflight[0] if self._inflight else None
        if s is None or s.seq != seq:
            raise ConnectionError(f"reply {seq} out of step")
        if status == Status.OK:
            if s.opcode == Opcode.READ:
                frames.recv_exact(sock, s.view)
                if s.checksum and crc32(s.view) != crc:
                    self._pop(s)
                    s.ticket.fail(TransportError(
                        "checksum", f"READ from {self.ep.target} region {s.region} "
                        f"offset {s.offset}: checksum mismatch"))
                    return
            self._pop(s)
            s.ticket.slice_done(len(s.view))
        elif status == Status.CHECKSUM:
            self._pop(s)
            s.ticket.fail(TransportError(
                "checksum", f"{self.ep.target} rejected WRITE to region {s.region} "
                f"offset {s.offset}: checksum mismatch"))
        else:
            msg = memoryview(bytearray(length))
            frames.recv_exact(sock, msg)
            self._pop(s)
            s.ticket.fail(TransportError("refused", f"{self.ep.target}: "
                                         f"{bytes(msg).decode(errors='replace')}"))

    def _pop(self, s: _Slice) -> None:
        with self._cv:
            if self._inflight and self._inflight[0] is s:
                self._inflight.popleft()

    def _break(self, why: str) -> None:
        with self._cv:
            if self.broken:
                return
            self.broken = True
            self.error = why
            orphans = list(self._inflight) + list(self._queue)
            self._inflight.clear()
            self._queue.clear()
            self._cv.notify_all()
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.sock.close()
        if orphans or not self.ep.closed:
            log.debug("tcp_stream_broken", target=self.ep.target, stream=self.index, error=why)
        self.ep.redispatch(orphans, self)

    def close(self) -> None:
        self._break("closed")


class _Endpoint:
    """All streams to one target."""

    def __init__(self, target: str, streams: int, connect_timeout_s: float,
                 io_timeout_s: float) -> None:
        self.target = target
        self.addr = parse_addr(target)
        self.connect_timeout_s = connect_timeout_s
        self.io_timeout_s = io_timeout_s
        self.closed = False
        self._lock = threading.Lock()
        self._rr = 0
        self.streams = [_Stream(self, i) for i in range(streams)]

    @property
    def in_flight(self) -> int:
        return sum(s.load for s in self.streams)

    @property
    def dead(self) -> bool:
        return all(s.broken for s in self.streams)

    def renew(self) -> None:
        """Replace broken, idle streams (the next attempt re-establishes them)."""
        with self._lock:
            for i, s in enumerate(self.streams):
                if s.broken and not self.closed:
                    self.streams[i] = _Stream(self, i)

    def dispatch(self, slices: list[_Slice], plan: list[slicing.Slice]) -> None:
        for s, p in zip(slices, plan, strict=True):
            self._place(s, p.path)

    def redispatch(self, orphans: list[_Slice], failed: _Stream) -> None:
        for s in orphans:
            s.tried.add(failed.index)
            if self.closed:
                s.ticket.fail(TransportError("closed", f"endpoint {self.target} closed"))
                continue
            self._place(s, failed.index + 1, failed)

    def _place(self, s: _Slice, start: int, failed: _Stream | None = None) -> None:
        n = len(self.streams)
        for k in range(n):
            i = (start + k) % n
            st = self.streams[i]
            if i in s.tried or st.broken:
                continue
            if st.push(s):
                return
        errors = {st.error for st in self.streams if st.error}
        if failed is not None:
            errors.add(failed.error)
        code = "unreachable" if not any(st.connected for st in self.streams) else "broken"
        s.ticket.fail(TransportError(code, f"all {n} streams to {self.target} failed: "
                                     + "; ".join(sorted(errors))[:500]))

    def close(self) -> None:
        self.closed = True
        for st in self.streams:
            st.close()


class TcpSender(Sender):
    scheme = "tcp"

    def __init__(self, streams: int = 4, max_endpoints: int = 64,
                 min_slice: int = slicing.MIN_SLICE, max_slice: int = slicing.MAX_SLICE,
                 connect_timeout_s: float = 3.0, io_timeout_s: float = 30.0) -> None:
        self.streams = max(1, streams)
        self.min_slice = min_slice
        self.max_slice = max_slice
        self.connect_timeout_s = connect_timeout_s
        self.io_timeout_s = io_timeout_s
        self._lock = threading.Lock()
        self._pool: SievePool[str, _Endpoint] = SievePool(max_endpoints, busy=lambda e: e.in_flight > 0)
        self._rr = 0
        self._closed = False

    @property
    def endpoints(self) -> list[str]:
        return list(self._pool)

    def endpoint_evictions(self) -> int:
        return self._pool.evictions

    def submit(self, req: Request) -> Ticket:
        plan = slicing.plan(req.length, self.streams, self._rr, self.min_slice, self.max_slice)
        self._rr += 1
        t = Ticket(req.length, len(plan))
        try:
            ep = self._endpoint(req.target)
        except TransportError as e:
            t.fail(e)
            return t
        slices = [
            _Slice(t, req.opcode, req.local[p.offset : p.offset + p.length], req.region,
                   req.offset + p.offset, req.checksum)
            for p in plan
        ]
        ep.dispatch(slices, plan)
        return t

    def _endpoint(self, target: str) -> _Endpoint:
        with self._lock:
            if self._closed:
                raise TransportError("closed", "sender is closed")
            ep = self._pool.get(target)
            if ep is not None and ep.dead and ep.in_flight == 0:
                self._pool.remove(target)
                ep = None
            if ep is None:
                ep = _Endpoint(target, self.streams, self.connect_timeout_s, self.io_timeout_s)
                for _, old in self._pool.put(target, ep):
                    old.close()
            else:
                ep.renew()
            return ep

    def close(self) -> None:
        with self._lock:
            self._closed = True
            eps = [self._pool.remove(k) for k in list(self._pool)]
        for ep in eps:
            if ep is not None:
                ep.close()
