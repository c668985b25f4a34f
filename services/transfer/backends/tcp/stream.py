"""One TCP stream of an endpoint: a connection, its thread, and who may write or read it.

Lifecycle of a slice on a stream::

    queued --(the stream's thread takes the write right)--> sent --> in flight --> replied
    (or) sent inline by the submitting thread when nobody else writes ------^
    in flight --(the reader: the stream's thread, or a thread waiting on the ticket)--> done

Two rights, held under ``_cv``: *writing* (``_sending``) and *reading* (``_reading``).
The thread (one per stream) writes what is queued and reads replies for slices it
sent or that someone asked about (``kick``). A slice sent inline is *lazy*: its reply
is read by whoever waits on its ticket (``drive``, on the waiting thread: no hand-off
between threads on the way back), or by the thread once the ticket is observed any
other way (``kick``: a callback, a status poll, ``done``), or by the next reader of
the stream (replies come in order); READ payloads beyond ``LAZY_READ_MAX`` unread are
always read by the thread. The stream breaks on any socket error or when no
reply came for ``io_timeout_s``; its queued and in-flight slices go back to the
endpoint (``redispatch``), which tries another stream.
"""

import select
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from services.transfer import data_auth
from services.transfer.backends.contract import Opcode, Ticket, TransportError, crc32
from services.transfer.backends.tcp import frames
from services.transfer.backends.tcp.frames import FLAG_CRC, REP, REQ, Status

log = structlog.get_logger()

# Inline slices' replies wait for a reader while at most this many READ payload bytes
# are unread on the stream; past it the stream's thread reads them (a peer whose
# replies nobody reads stops reading requests once its socket buffers are full).
LAZY_READ_MAX = 4 << 20


@dataclass(eq=False)
class InFlightSlice:
    """One slice in flight on a stream: the bytes, where they go and the ticket to settle."""

    ticket: Ticket
    opcode: Opcode
    view: memoryview
    region: int
    offset: int
    checksum: bool
    token: bytes = frames.NO_TOKEN  # the grant's capability, sent with the request
    seq: int = 0
    stream: "Stream | None" = None  # where it is queued / in flight now
    finished: bool = False  # its reply was read (or it failed)
    tried: set[int] = field(default_factory=set)


def _sendmsg_all(sock: socket.socket, hdr: bytes, view: memoryview) -> None:
    """``hdr`` then ``view`` in as few ``sendmsg`` calls as the kernel allows (one, when
    its buffer has room)."""
    n = sock.sendmsg([hdr, view] if len(view) else [hdr])
    if n == len(hdr) + view.nbytes:
        return
    if n < len(hdr):
        sock.sendall(hdr[n:])
        n = len(hdr)
    sock.sendall(view.cast("B")[n - len(hdr) :])


def why(e: BaseException, io_timeout_s: float | None) -> str:
    if isinstance(e, (BlockingIOError, TimeoutError)):  # SO_SNDTIMEO / SO_RCVTIMEO ran out
        return f"no progress in {io_timeout_s}s (timed out)"
    return str(e)


class Endpoint(Protocol):
    """What a stream needs of the endpoint that owns it (the sender's, one per target)."""

    target: str
    addr: tuple[str, int]
    connect_timeout_s: float
    io_timeout_s: float
    closed: bool
    key: bytes | None  # the run's data key (the HELLO's MAC)
    session: bytes  # this endpoint's session id (its streams share it)

    def redispatch(self, orphans: list["InFlightSlice"], failed: "Stream") -> None: ...


class Stream:
    """One TCP connection of an endpoint, with the thread that writes and reads it."""

    def __init__(self, ep: Endpoint, index: int) -> None:
        self.ep = ep
        self.index = index
        self.sock: socket.socket | None = None
        self.broken = False
        self.connected = False
        self.error = ""
        self._cv = threading.Condition()
        self._queue: deque[InFlightSlice] = deque()
        self._inflight: deque[InFlightSlice] = deque()
        self._seq = 0
        self._sending = False  # the write right: the thread or an inline submitter
        self._reading = False  # the read right: the thread or a driving waiter
        self._kicked = False  # the thread should read the replies in flight
        self._unread = 0  # READ payload bytes in flight (the peer blocks once its buffers fill)
        self._hdr = memoryview(bytearray(REP.size))
        self._poll = select.poll()
        threading.Thread(target=self._run, name=f"tcp-stream-{index}", daemon=True).start()

    @property
    def load(self) -> int:
        return len(self._queue) + len(self._inflight)

    def push(self, s: InFlightSlice) -> bool:
        with self._cv:
            if self.broken:
                return False
            s.stream = self
            self._queue.append(s)
            self._cv.notify()
        return True

    def send_inline(self, s: InFlightSlice) -> bool:
        """Send ``s`` on the calling thread if the stream is connected and nobody else
        writes to it (nothing queued, no send under way); False leaves it to ``push``.
        Its reply is left for ``drive`` (see the module docstring)."""
        with self._cv:
            if self.broken or self.sock is None or self._queue or self._sending:
                return False
            s.stream = self
            self._claim(s)
            if self._unread > LAZY_READ_MAX:
                self._kicked = True  # drain READ payloads before the peer stalls on them
            if self._kicked:
                self._cv.notify()
            sock = self.sock
        try:
            self._send(sock, s)
        except OSError as e:
            self._break(f"stream to {self.ep.target} broke: {why(e, self.ep.io_timeout_s)}")
            return True  # _break handed the slice to another stream (or failed it)
        self._sent()
        return True

    def kick(self, s: InFlightSlice) -> None:
        """Have the thread read the replies up to ``s``'s (someone watches its ticket)."""
        with self._cv:
            if not self._kicked and not s.finished and s.stream is self:
                self._kicked = True
                self._cv.notify()

    def drive(self, s: InFlightSlice, deadline: float | None) -> bool:
        """Read replies on the calling thread until ``s`` (in flight here) has its own or
        ``deadline`` (monotonic) passes. False when someone else holds the read right
        or ``s`` is not in flight on this stream (then wait on the ticket instead)."""
        with self._cv:
            if self._reading or self.broken or s.stream is not self or s not in self._inflight:
                return False
            self._reading = True
            sock = self.sock
        assert sock is not None
        io = self.ep.io_timeout_s
        err: BaseException | None = None
        try:
            while not s.finished and not self.broken:
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    if (io is None or left < io) and not self._poll.poll(int(left * 1000) + 1):
                        break  # the caller's deadline, before the stream's own timeout
                self._reply(sock, self._hdr)  # SO_RCVTIMEO: io_timeout_s without progress
        except (OSError, ConnectionError, ValueError) as e:
            err = e
        finally:
            self._release_read()
        if err is not None:
            self._break(f"stream to {self.ep.target} broke: {why(err, io)}")
        return True

    def _release_read(self) -> None:
        with self._cv:
            self._reading = False
            if self._inflight and self._kicked:
                self._cv.notify()

    def _claim(self, s: InFlightSlice) -> None:
        """Under ``_cv``: number ``s``, count it in flight, take the write right."""
        self._seq += 1
        s.seq = self._seq
        self._inflight.append(s)
        self._sending = True
        if s.opcode == Opcode.READ:
            self._unread += len(s.view)

    def _sent(self) -> None:
        with self._cv:
            self._sending = False
            if self._queue:
                self._cv.notify()

    # -------------------------------------------------------------- thread

    def _run(self) -> None:
        """One thread per stream: send whatever is queued, read replies when asked to."""
        try:
            sock = socket.create_connection(self.ep.addr, timeout=self.ep.connect_timeout_s)
            frames.tune(sock)
            frames.set_io_timeout(sock, self.ep.io_timeout_s)
            sock.sendall(data_auth.hello(self.ep.key or b"", self.ep.session))
        except OSError as e:
            self._break(f"connect to {self.ep.target} failed: {e}")
            return
        with self._cv:
            if self.broken:  # closed while connecting
                sock.close()
                return
            self.sock = sock
            self._poll.register(sock, select.POLLIN)
            self.connected = True
        try:
            while True:
                s = self._next()
                if s is None:
                    return
                if s is not True:
                    self._send(sock, s)
                    self._sent()
                    continue
                try:
                    self._reply(sock, self._hdr)
                finally:
                    self._release_read()
        except (OSError, ConnectionError, ValueError) as e:
            self._break(f"stream to {self.ep.target} broke: {why(e, self.ep.io_timeout_s)}")

    def _next(self) -> "InFlightSlice | bool | None":
        """Wait for work: a slice to send, True to read one reply, None when broken."""
        with self._cv:
            while True:
                if self.broken:
                    return None
                if self._queue and not self._sending:
                    s = self._queue.popleft()
                    self._claim(s)
                    self._kicked = True  # nobody waits on it inline: read its reply here
                    return s
                if self._inflight and not self._reading and self._kicked:
                    self._reading = True
                    return True
                self._cv.wait()

    def _send(self, sock: socket.socket, s: InFlightSlice) -> None:
        s.ticket.started()
        flags = FLAG_CRC if s.checksum else 0
        if s.opcode == Opcode.WRITE:
            crc = crc32(s.view) if s.checksum else 0
            hdr = REQ.pack(1, flags, 0, s.region, s.seq, s.offset, len(s.view), crc, s.token)
            _sendmsg_all(sock, hdr, s.view)
        else:
            sock.sendall(REQ.pack(0, flags, 0, s.region, s.seq, s.offset, len(s.view), 0, s.token))

    def _reply(self, sock: socket.socket, hdr: memoryview) -> None:
        frames.recv_exact(sock, hdr)
        status, crc, seq, length = REP.unpack(hdr)
        with self._cv:
            s = self._inflight[0] if self._inflight else None
        if s is None or s.seq != seq:
            raise ConnectionError(f"reply {seq} out of step")
        if status == Status.OK:
            if s.opcode == Opcode.READ:
                if length != len(s.view):
                    raise ConnectionError(
                        f"reply {seq}: {length} bytes for a READ of {len(s.view)}"
                    )
                frames.recv_exact(sock, s.view)
                if s.checksum and crc32(s.view) != crc:
                    self._pop(s)
                    s.ticket.fail(
                        TransportError(
                            "checksum",
                            f"READ from {self.ep.target} region {s.region} "
                            f"offset {s.offset}: checksum mismatch",
                        )
                    )
                    return
            self._pop(s)
            s.ticket.slice_done(len(s.view))
        elif status == Status.CHECKSUM:
            self._pop(s)
            s.ticket.fail(
                TransportError(
                    "checksum",
                    f"{self.ep.target} rejected WRITE to region {s.region} "
                    f"offset {s.offset}: checksum mismatch",
                )
            )
        else:
            if length > frames.MAX_REFUSAL:  # checked before anything is allocated
                raise ConnectionError(f"reply {seq}: a refusal of {length} bytes")
            msg = memoryview(bytearray(length))
            frames.recv_exact(sock, msg)
            self._pop(s)
            s.ticket.fail(
                TransportError(
                    "refused", f"{self.ep.target}: {bytes(msg).decode(errors='replace')}"
                )
            )

    def _pop(self, s: InFlightSlice) -> None:
        with self._cv:
            if self._inflight and self._inflight[0] is s:
                self._inflight.popleft()
                if s.opcode == Opcode.READ:
                    self._unread -= len(s.view)
                if not self._inflight:
                    self._kicked = False  # the next inline slice is lazy again
            s.finished = True

    def _break(self, why: str) -> None:
        with self._cv:
            if self.broken:
                return
            self.broken = True
            self.error = why
            orphans = list(self._inflight) + list(self._queue)
            self._inflight.clear()
            self._queue.clear()
            self._unread = 0
            self._cv.notify_all()
            sock = self.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        if orphans or not self.ep.closed:
            log.debug("tcp_stream_broken", target=self.ep.target, stream=self.index, error=why)
        self.ep.redispatch(orphans, self)

    def close(self) -> None:
        self._break("closed")
