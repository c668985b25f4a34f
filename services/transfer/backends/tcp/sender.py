"""TCP initiator: endpoints of several parallel streams, pooled and evicted by SIEVE.

Lifecycle::

    submit(req) -> Ticket            request sliced (slicing.plan) over the endpoint's streams
      endpoint = pool[target]        made on demand: ``streams`` TCP connections, each with
                                     one thread (tcp/stream.py)
      request <= inline_max bytes: slices sent by the submitting thread (queued where
                                   their stream is busy)
      bigger request:            slices -> stream queue -> sent by the stream's thread
      in flight -> reply read by the thread waiting on the ticket (Ticket.wait drives
                   the streams: no hand-off between threads) or by the stream's thread
                   (queued slices, and tickets observed by callback or poll)
                -> acked (Ticket.slice_done) | failed
    a stream that breaks (reset, EOF, timeout, connect refused) hands every queued and
    in-flight slice to another live stream of the endpoint; a slice that has failed on
    every stream fails its ticket (``unreachable`` when no stream ever connected, else
    ``broken``). A broken stream is replaced on the next submit to that target; an
    endpoint with no live stream is dropped from the pool (and made again next time).

Bytes are never copied in Python: WRITE payloads go out with ``sendmsg`` from the
caller's memory, READ payloads arrive with ``recv_into`` the caller's memory.

Why inline sends and waiter-read replies: a 1 MiB transfer over loopback takes a few
hundred microseconds, and each hand-off between threads (submitter -> stream thread,
stream thread -> waiter) cost about as much on a busy 2-core host. The price: ``submit``
of a request up to ``inline_max`` bytes returns once the kernel has taken its bytes
(not before they are sent, as with the threads), so callers that must never block
(an event loop) pass ``inline_max=0`` or submit from a worker thread.
"""

import secrets
import threading
import time

from services.transfer.backends import slicing
from services.transfer.backends.contract import Request, Sender, Ticket, TransportError
from services.transfer.backends.sieve import SievePool
from services.transfer.backends.tcp.frames import NO_TOKEN
from services.transfer.backends.tcp.stream import InFlightSlice, Stream

# Requests up to INLINE_MAX bytes are sent by the submitting thread, in INLINE_SLICE
# slices dealt over the streams (so the peer starts copying the first while the next
# goes out); bigger ones go to the streams' threads in slicing.plan's bigger slices
# (measured on loopback: one sending thread wins up to a few MiB, parallel ones beyond).
INLINE_MAX = 4 << 20
INLINE_SLICE = 512 << 10


def parse_addr(target: str) -> tuple[str, int]:
    if not target.startswith("tcp://"):
        raise TransportError("bad_request", f"not a tcp target: {target!r}")
    host, _, port = target[len("tcp://") :].rpartition(":")
    if not host or not port.isdigit():
        raise TransportError("bad_request", f"not host:port: {target!r}")
    return host.strip("[]"), int(port)


class _Endpoint:
    """All streams to one target."""

    def __init__(
        self,
        target: str,
        streams: int,
        connect_timeout_s: float,
        io_timeout_s: float,
        key: bytes | None = None,
    ) -> None:
        self.target = target
        self.key = key
        self.session = secrets.token_bytes(16)
        self.addr = parse_addr(target)
        self.connect_timeout_s = connect_timeout_s
        self.io_timeout_s = io_timeout_s
        self.closed = False
        self._lock = threading.Lock()
        self._rr = 0
        self.streams = [Stream(self, i) for i in range(streams)]

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
                    self.streams[i] = Stream(self, i)

    def dispatch(
        self, slices: list[InFlightSlice], plan: list[slicing.Slice], inline: bool = False
    ) -> None:
        """``inline``: send each slice on the calling thread when its stream is free
        (else queue it); otherwise queue them all for the streams' threads."""
        for s, p in zip(slices, plan, strict=True):
            if inline and self.streams[p.path % len(self.streams)].send_inline(s):
                continue
            self._place(s, p.path)

    def redispatch(self, orphans: list[InFlightSlice], failed: Stream) -> None:
        for s in orphans:
            s.tried.add(failed.index)
            if self.closed:
                s.ticket.fail(TransportError("closed", f"endpoint {self.target} closed"))
                continue
            self._place(s, failed.index + 1, failed)

    def _place(self, s: InFlightSlice, start: int, failed: Stream | None = None) -> None:
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
        s.ticket.fail(
            TransportError(
                code, f"all {n} streams to {self.target} failed: " + "; ".join(sorted(errors))[:500]
            )
        )

    def close(self) -> None:
        self.closed = True
        for st in self.streams:
            st.close()


class TcpSender(Sender):
    """Moves bytes to and from peers' regions over several TCP streams per endpoint."""

    scheme = "tcp"

    def __init__(
        self,
        streams: int = 4,
        max_endpoints: int = 64,
        min_slice: int = slicing.MIN_SLICE,
        max_slice: int = slicing.MAX_SLICE,
        connect_timeout_s: float = 3.0,
        io_timeout_s: float = 30.0,
        inline_max: int = INLINE_MAX,
        inline_slice: int = INLINE_SLICE,
        key: bytes | None = None,
    ) -> None:
        self.key = key  # the run's data key: every stream's HELLO is MAC'd with it
        self.streams = max(1, streams)
        self.inline_max = inline_max
        self.inline_slice = inline_slice
        self.min_slice = min_slice
        self.max_slice = max_slice
        self.connect_timeout_s = connect_timeout_s
        self.io_timeout_s = io_timeout_s
        self._lock = threading.Lock()
        self._pool: SievePool[str, _Endpoint] = SievePool(
            max_endpoints, busy=lambda e: e.in_flight > 0
        )
        self._rr = 0
        self._closed = False

    @property
    def endpoints(self) -> list[str]:
        return list(self._pool)

    def endpoint_evictions(self) -> int:
        return self._pool.evictions

    def submit(self, req: Request) -> Ticket:
        inline = req.length <= self.inline_max
        if inline:
            plan = slicing.plan(
                req.length, self.streams, self._rr, self.inline_slice, self.inline_slice
            )
        else:
            plan = slicing.plan(req.length, self.streams, self._rr, self.min_slice, self.max_slice)
        self._rr += 1
        t = Ticket(req.length, len(plan))
        try:
            ep = self._endpoint(req.target)
        except TransportError as e:
            t.fail(e)
            return t
        slices = [
            InFlightSlice(
                t,
                req.opcode,
                req.local[p.offset : p.offset + p.length],
                req.region,
                req.offset + p.offset,
                req.checksum,
                req.token or NO_TOKEN,
            )
            for p in plan
        ]
        ep.dispatch(slices, plan, inline)
        if not t.ended:
            t.driver = lambda deadline: _drive(t, slices, deadline)
            t.kicker = lambda: _kick(slices)
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
                ep = _Endpoint(
                    target, self.streams, self.connect_timeout_s, self.io_timeout_s, self.key
                )
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


def _drive(t: Ticket, slices: list[InFlightSlice], deadline: float | None) -> None:
    """Read ``t``'s replies on the calling thread, stream by stream, until it ended, the
    deadline passed, or a slice is somewhere this thread cannot read (then the caller
    kicks the streams and waits)."""
    for s in slices:
        while not s.finished and not t.ended:
            st = s.stream
            if st is None or not st.drive(s, deadline):
                return
            if deadline is not None and time.monotonic() >= deadline:
                return


def _kick(slices: list[InFlightSlice]) -> None:
    for s in slices:
        st = s.stream
        if st is not None:
            st.kick(s)
