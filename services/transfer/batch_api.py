"""The batch transfer API of the paper's Listing 1, over the transfer-engine backends.

    engine = TransferEngine("tcp")                     # serves this process's segment
    rid = engine.register_local_memory(buf)            # registerLocalMemory
    bid = engine.allocate_batch_id(8)                  # allocateBatchID
    engine.submit_transfer(bid, [TransferRequest(...)])  # submitTransfer (see below)
    engine.get_transfer_status(bid, 0)                 # getTransferStatus -> TransferStatus
    await engine.wait_batch(bid)                       # (helper) until every entry ended
    engine.free_batch_id(bid)                          # freeBatchID

A batch's lifecycle: ALLOCATED (empty, up to ``batch_size`` entries) -> entries
submitted, each PENDING -> TRANSFERRING -> SUCCESS | FAILED on its own -> freed.
Freeing a batch with entries still running is refused (``busy``); a batch whose
entries failed (a dead peer, a checksum mismatch) has ended and frees normally.

A *segment* is what peers see of this engine: its registered memory, served by the
backend's Receiver at ``engine.segment``. A request names a local region and span,
the peer's segment, region id and offset. Where this engine can only initiate
(``serve=False``) nothing is exposed.
"""

import asyncio
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

from services.common.errors import CodedError
from services.transfer import backends
from services.transfer.backends.contract import (
    Opcode,
    Poll,
    Region,
    Request,
    Ticket,
    TransportError,
)


class TransferApiError(CodedError, ValueError):
    """A misuse of the batch API (unknown batch or region, a busy batch)."""


@dataclass(frozen=True)
class TransferRequest:
    """One entry of a transfer batch: which local bytes to read or write at which peer."""

    opcode: Opcode
    source: int  # local region id
    source_offset: int
    length: int
    target: str  # the peer's segment (TransferEngine.segment there)
    target_region: int
    target_offset: int
    checksum: bool = False
    token: bytes = b""  # the target grant's capability (GRANTED ``token``)


@dataclass(frozen=True)
class TransferStatus:
    """Where one batch entry stands: its state, bytes moved and, on failure, why."""

    state: Poll
    transferred_bytes: int
    code: str = ""
    error: str = ""


@dataclass
class _Batch:
    size: int
    tickets: list[Ticket]


class TransferEngine:
    """The paper's batch transfer API (Listing 1) over one transport backend."""

    def __init__(
        self,
        backend: str = "tcp",
        *,
        serve: bool = True,
        sender_opts: dict[str, Any] | None = None,
        receiver_opts: dict[str, Any] | None = None,
    ) -> None:
        avail = backends.availability(backend)
        if not avail.ok:
            raise TransportError("unavailable", f"backend {backend}: {avail.reason}")
        self.backend = backend
        self.sender = backends.make_sender(backend, **(sender_opts or {}))
        self.receiver = backends.make_receiver(backend, **(receiver_opts or {})) if serve else None
        self._regions: dict[int, Region] = {}
        self._owned: dict[int, shared_memory.SharedMemory] = {}
        self._batches: dict[int, _Batch] = {}
        self._ids = itertools.count(1)
        self._region_ids = itertools.count(1)
        self._lock = threading.Lock()

    @property
    def segment(self) -> str:
        if self.receiver is None:
            raise TransferApiError("bad_request", "this engine does not serve a segment")
        return self.receiver.address

    # ------------------------------------------------------------------ memory

    def register_local_memory(
        self, buf: Any, location: str = "cpu:0", name: str = "", offset: int = 0
    ) -> int:
        """Register ``buf`` (anything with the buffer protocol, writable); ``name`` is its
        shared-memory segment name (needed for peers on this host to map it, and
        ``offset`` where ``buf`` starts in that segment). Returns the region id."""
        view = memoryview(buf).cast("B")
        if view.readonly:
            raise TransferApiError("bad_request", "registered memory must be writable")
        region = Region(
            id=next(self._region_ids),
            buf=view,
            location=location,
            name=name,
            extra={"offset": offset},
        )
        register = getattr(self.sender, "register", None)
        if register is not None:
            register(region)
        if self.receiver is not None and (self.backend != "shm" or name):
            self.receiver.expose(region)
        with self._lock:
            self._regions[region.id] = region
        return region.id

    def allocate_managed_buffer(self, size: int, location: str = "cpu:0") -> tuple[int, memoryview]:
        """A shared-memory buffer registered with this engine (freed at ``close``)."""
        shm = shared_memory.SharedMemory(create=True, size=size)
        rid = self.register_local_memory(shm.buf[:size], location, name=shm.name)
        self._owned[rid] = shm
        return rid, self._regions[rid].buf

    def unregister_local_memory(self, region_id: int) -> None:
        """Stop serving the region and let go of this engine's view of it (so the memory's
        owner can unmap it)."""
        with self._lock:
            region = self._regions.pop(region_id, None)
        withdraw = getattr(self.receiver, "withdraw", None)
        if withdraw is not None:
            withdraw(region_id)
        if region is not None and region_id not in self._owned:
            try:
                region.buf.release()
            except BufferError:  # a transfer still holds a slice of it
                pass

    def region(self, region_id: int) -> memoryview:
        r = self._regions.get(region_id)
        if r is None:
            raise TransferApiError("bad_request", f"no registered region {region_id}")
        return r.buf

    # ------------------------------------------------------------------ batches

    def allocate_batch_id(self, batch_size: int) -> int:
        if batch_size <= 0:
            raise TransferApiError("bad_request", f"batch_size must be positive, got {batch_size}")
        with self._lock:
            bid = next(self._ids)
            self._batches[bid] = _Batch(batch_size, [])
        return bid

    def submit_transfer(self, batch_id: int, entries: list[TransferRequest]) -> int:
        """Start every entry; returns 0 without waiting for any ack. Over TCP a request
        of up to 4 MiB is written by this thread (it returns once the kernel holds the
        bytes, ~0.1 ms per MiB here: an event loop that cannot spare that submits from
        a worker thread); larger ones go to the stream threads. Nothing is started when
        an entry is invalid (unknown region, span outside it, batch full)."""
        with self._lock:
            batch = self._batch(batch_id)
            if len(batch.tickets) + len(entries) > batch.size:
                raise TransferApiError(
                    "batch_full",
                    f"batch {batch_id} holds {batch.size} "
                    f"entries, {len(batch.tickets)} used, {len(entries)} more",
                )
            reqs = [self._request(e) for e in entries]
            tickets = [self.sender.submit(r) for r in reqs]
            batch.tickets.extend(tickets)
        return 0

    def get_transfer_status(self, batch_id: int, index: int) -> TransferStatus:
        with self._lock:
            batch = self._batch(batch_id)
            if not 0 <= index < len(batch.tickets):
                raise TransferApiError("bad_request", f"batch {batch_id} has no entry {index}")
            t = batch.tickets[index]
        return _status(t)

    def batch_status(self, batch_id: int) -> list[TransferStatus]:
        with self._lock:
            tickets = list(self._batch(batch_id).tickets)
        return [_status(t) for t in tickets]

    def free_batch_id(self, batch_id: int) -> int:
        with self._lock:
            batch = self._batch(batch_id)
            running = sum(not t.done for t in batch.tickets)
            if running:
                raise TransferApiError("busy", f"batch {batch_id} has {running} transfers running")
            del self._batches[batch_id]
        return 0

    @property
    def open_batches(self) -> int:
        return len(self._batches)

    def on_batch_done(self, batch_id: int, cb: Callable[[], None]) -> None:
        """Call ``cb()`` once every entry of the batch has ended (at once if all have), on
        the thread that ended the last one: after it, no byte of the batch moves."""
        with self._lock:
            tickets = list(self._batch(batch_id).tickets)
        if not tickets:
            cb()
            return
        left = [len(tickets)]
        lock = threading.Lock()

        def one(_t: Ticket) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                cb()

        for t in tickets:
            t.on_done(one)

    async def wait_batch(self, batch_id: int, timeout: float | None = None) -> list[TransferStatus]:
        """Wait until every entry of the batch ended (TimeoutError after ``timeout``)."""
        with self._lock:
            tickets = list(self._batch(batch_id).tickets)
        loop = asyncio.get_running_loop()
        futs = []
        for t in tickets:
            fut = loop.create_future()
            t.on_done(lambda _t, f=fut: loop.call_soon_threadsafe(_settle, f))
            futs.append(fut)
        if futs:
            await asyncio.wait_for(asyncio.gather(*futs), timeout)
        return [_status(t) for t in tickets]

    def wait_batch_sync(self, batch_id: int, timeout: float | None = None) -> list[TransferStatus]:
        with self._lock:
            tickets = list(self._batch(batch_id).tickets)
        for t in tickets:
            t.wait(timeout)
        return [_status(t) for t in tickets]

    def transfer_sync(self, entries: list[TransferRequest], timeout: float | None = None) -> None:
        """Submit, wait and free one batch; raise the first entry's error."""
        bid = self.allocate_batch_id(max(1, len(entries)))
        self.submit_transfer(bid, entries)
        statuses = self.wait_batch_sync(bid, timeout)
        try:
            for s in statuses:
                if s.state != Poll.SUCCESS:
                    raise TransportError(s.code or "timeout", s.error or "transfer did not end")
        finally:
            if all(s.state in (Poll.SUCCESS, Poll.FAILED) for s in statuses):
                self.free_batch_id(bid)

    def close(self) -> None:
        self.sender.close()
        if self.receiver is not None:
            self.receiver.close()
        for rid, shm in self._owned.items():
            region = self._regions.pop(rid, None)
            if region is not None:
                try:
                    region.buf.release()
                except BufferError:
                    pass
            try:
                shm.close()
            except BufferError:  # a view is still out there: leave the mapping to exit
                shm._buf = None  # type: ignore[attr-defined]
                shm._mmap = None  # type: ignore[attr-defined]
            try:
                shm.unlink()
            except FileNotFoundError:
                pass
        self._owned.clear()

    # ------------------------------------------------------------------ internals

    def _batch(self, batch_id: int) -> _Batch:
        b = self._batches.get(batch_id)
        if b is None:
            raise TransferApiError("bad_request", f"no batch {batch_id} (freed or never allocated)")
        return b

    def _request(self, e: TransferRequest) -> Request:
        r = self._regions.get(e.source)
        if r is None:
            raise TransferApiError("bad_request", f"source region {e.source} is not registered")
        if e.length < 0 or e.source_offset < 0 or e.source_offset + e.length > len(r.buf):
            raise TransferApiError(
                "bad_request",
                f"span {e.source_offset}+{e.length} outside "
                f"region {e.source} of {len(r.buf)} bytes",
            )
        return Request(
            opcode=e.opcode,
            local=r.buf[e.source_offset : e.source_offset + e.length],
            target=e.target,
            region=e.target_region,
            offset=e.target_offset,
            checksum=e.checksum,
            token=e.token,
        )


def _status(t: Ticket) -> TransferStatus:
    state = t.poll()  # polling also asks a lazy backend to finish the work (Ticket.kicker)
    e = t.error
    return TransferStatus(
        state=state,
        transferred_bytes=t.transferred,
        code=e.code if e else "",
        error=e.message if e else "",
    )


def _settle(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
