"""The transfer engine's backend contract: one-sided READ/WRITE between registered memory.

A node *exposes* regions of its memory through a :class:`Receiver` (the target side);
another node's :class:`Sender` (the initiator side) moves bytes between its own
registered memory and those regions, like an RDMA NIC would:

    WRITE  local[offset, offset+length)  ->  remote region[remote_offset, ...)
    READ   remote region[remote_offset, ...)  ->  local[offset, offset+length)

Lifecycle of one request (a :class:`Ticket`)::

    PENDING --a path picked it up--> TRANSFERRING --every slice acked--> SUCCESS
                                         \\--a slice failed on every path--> FAILED

A request is cut into slices (:mod:`services.transfer.backends.slicing`); each slice may
take a different path (a TCP stream, a NIC); a slice whose path breaks is retried on
another, and the request fails only when every path failed. ``Ticket.error`` then
says what happened (``code``: unreachable, broken, checksum, refused, timeout,
closed). Completion is asynchronous: poll the ticket or wait on it.

Backends live in one subpackage each (tcp/, shm/, rdma/); every backend's
``available()`` says whether it can run here and, if not, why.
"""

import threading
import time
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum

from services.common.errors import CodedError


class Poll(IntEnum):
    """State of a request (SGLang's ``KVPoll`` shape: FAILED is 0, success is last)."""

    FAILED = 0
    PENDING = 1
    TRANSFERRING = 2
    SUCCESS = 3


class Opcode(IntEnum):
    """The direction of a one-sided transfer: read from or write to the peer."""

    READ = 0
    WRITE = 1


class TransportError(CodedError, RuntimeError):
    """A transfer that did not complete; ``code`` is stable, ``message`` for people."""


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run here, and if not why."""

    ok: bool
    reason: str = ""


@dataclass(frozen=True)
class Request:
    """One entry of a batch (Listing 1's ``Request``).

    ``target`` names the peer's segment as its Receiver advertises it (``tcp://h:p``,
    ``shm://name``, ``rdma://h:p``; a registered backend its own)."""

    opcode: Opcode
    local: memoryview  # the initiator's bytes (read from for WRITE, written for READ)
    target: str
    region: int  # region id on the target
    offset: int  # byte offset in that region
    checksum: bool = False
    token: bytes = b""  # the capability the target's grant asks for (TCP sends it)

    @property
    def length(self) -> int:
        return len(self.local)


def crc32(buf: memoryview | bytes) -> int:
    return zlib.crc32(buf) & 0xFFFFFFFF


class Ticket:
    """Completion of one request, shared between the submitter and the worker threads.

    Cheap to make: the waitable event only exists once someone waits on an unfinished
    ticket (most small transfers have finished by then).

    A backend may leave part of the work to whoever looks at the ticket: ``driver``
    (``driver(deadline)``, monotonic or None) is run by ``wait`` on the waiting thread
    to make progress there (TCP reads its replies), and ``kicker()`` is run once by any
    other look (``poll``, ``done``, ``on_done``) to have the backend's threads do it.
    Read ``state`` through ``poll()`` for that reason."""

    __slots__ = (
        "length",
        "_lock",
        "_finished",
        "_event",
        "_left",
        "state",
        "transferred",
        "error",
        "_callbacks",
        "driver",
        "kicker",
    )

    def __init__(self, length: int, slices: int = 1) -> None:
        self.length = length
        self._lock = threading.Lock()
        self._finished = False
        self._event: threading.Event | None = None
        self._left = max(1, slices)
        self.state = Poll.PENDING
        self.transferred = 0
        self.error: TransportError | None = None
        self._callbacks: list[Callable[[Ticket], None]] | None = None
        self.driver: Callable[[float | None], None] | None = None
        self.kicker: Callable[[], None] | None = None

    def kick(self) -> None:
        k = self.kicker
        if k is not None and not self._finished:
            self.kicker = None
            k()

    def poll(self) -> Poll:
        self.kick()
        return self.state

    @property
    def ended(self) -> bool:
        """Whether the ticket ended, without kicking (for backends' own bookkeeping)."""
        return self._finished

    def started(self) -> None:
        if self.state == Poll.PENDING:
            with self._lock:
                if self.state == Poll.PENDING:
                    self.state = Poll.TRANSFERRING

    def slice_done(self, nbytes: int) -> None:
        with self._lock:
            if self._finished:
                return
            self.transferred += nbytes
            self._left -= 1
            if self._left > 0:
                return
            self.state = Poll.SUCCESS
            self._finished = True
        self._finish()

    def fail(self, error: TransportError) -> None:
        with self._lock:
            if self._finished:
                return
            self.state = Poll.FAILED
            self.error = error
            self._finished = True
        self._finish()

    def _finish(self) -> None:
        with self._lock:
            ev, cbs = self._event, self._callbacks
        if ev is not None:
            ev.set()
        for cb in cbs or ():
            cb(self)

    def on_done(self, cb: Callable[["Ticket"], None]) -> None:
        """Call ``cb(ticket)`` once the ticket ends (at once if it already has); ``cb``
        runs on whichever thread ended it."""
        with self._lock:
            if not self._finished:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(cb)
                waiting = True
            else:
                waiting = False
        if waiting:
            self.kick()
        else:
            cb(self)

    def wait(self, timeout: float | None = None) -> Poll:
        if self._finished:
            return self.state
        drive = self.driver
        if drive is not None:
            deadline = None if timeout is None else time.monotonic() + timeout
            drive(deadline)
            if self._finished:
                return self.state
            if deadline is not None:
                timeout = max(0.0, deadline - time.monotonic())
        with self._lock:
            if self._finished:
                return self.state
            if self._event is None:
                self._event = threading.Event()
            ev = self._event
        self.kick()
        ev.wait(timeout)
        return self.state

    @property
    def done(self) -> bool:
        self.kick()
        return self._finished


@dataclass
class Region:
    """Registered memory: ``buf`` is writable; ``name`` is how a same-host peer maps it
    (a shared-memory segment name), empty for private memory."""

    id: int
    buf: memoryview
    location: str = "cpu:0"
    name: str = ""
    extra: dict = field(default_factory=dict)


class Receiver(ABC):
    """Target side: serves READ/WRITE on its exposed regions until closed."""

    scheme: str = ""

    @abstractmethod
    def expose(self, region: Region) -> None: ...

    @property
    @abstractmethod
    def address(self) -> str:
        """How a Sender reaches this receiver (``scheme://...``)."""

    @abstractmethod
    def close(self) -> None: ...


class Sender(ABC):
    """Initiator side: submit requests, each completes asynchronously on its Ticket."""

    scheme: str = ""

    @abstractmethod
    def submit(self, req: Request) -> Ticket: ...

    @abstractmethod
    def close(self) -> None: ...

    def transfer(self, req: Request, timeout: float | None = None) -> None:
        """Submit and wait; raise the request's error (``timeout`` if it did not end)."""
        t = self.submit(req)
        if t.wait(timeout) == Poll.SUCCESS:
            return
        if t.error is not None:
            raise t.error
        raise TransportError(
            "timeout", f"{req.opcode.name} to {req.target} did not end in {timeout}s"
        )


def check_span(region: Region, offset: int, length: int) -> str | None:
    if offset < 0 or length < 0 or offset + length > len(region.buf):
        return f"span {offset}+{length} outside region {region.id} of {len(region.buf)} bytes"
    return None
