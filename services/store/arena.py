"""The node's KV arena: one POSIX shared-memory segment of ``capacity`` slots.

Slot ``i`` is bytes ``[i * block_bytes, (i + 1) * block_bytes)``. The store creates
the segment (and unlinks it at shutdown; if the store dies, the resource tracker of
the store process unlinks it). Workers on the same node attach by name and read and
write slots in place.

Attaching must not register the segment with the attaching process's
``multiprocessing.resource_tracker``: on Python < 3.13 ``SharedMemory`` always
registers, and the tracker then *unlinks* the store's segment when the worker
exits. We open the segment directly instead (``track=False`` on 3.13+).
"""

import gc
import mmap
import os
import secrets
import sys
from multiprocessing import shared_memory

from services.common import prefault


class ArenaError(RuntimeError):
    """The arena's shared-memory segment is missing, of the wrong size, or not ours to unlink."""

    pass


class Arena:
    """The node's KV slots in one shared-memory segment, made by the store and mapped by workers."""

    def __init__(
        self,
        name: str,
        capacity: int,
        block_bytes: int,
        buf: memoryview,
        owner: shared_memory.SharedMemory | None,
        mm: mmap.mmap | None,
    ) -> None:
        self.name = name
        self.capacity = capacity
        self.block_bytes = block_bytes
        self.size = capacity * block_bytes
        self.buf = buf  # writable, exactly ``size`` bytes
        self._owner = owner  # set in the creating process
        self._mm = mm  # set in attaching processes
        self._closed = False

    # ---------------------------------------------------------------- open

    @classmethod
    def create(cls, capacity: int, block_bytes: int, name: str | None = None) -> "Arena":
        if capacity <= 0 or block_bytes <= 0:
            raise ValueError("capacity and block_bytes must be positive")
        name = name or f"perigee_{os.getpid()}_{secrets.token_hex(4)}"
        shm = shared_memory.SharedMemory(name=name, create=True, size=capacity * block_bytes)
        buf = shm.buf[: capacity * block_bytes]
        return cls(shm.name, capacity, block_bytes, buf, owner=shm, mm=None)

    @classmethod
    def attach(cls, name: str, capacity: int, block_bytes: int) -> "Arena":
        size = capacity * block_bytes
        if sys.version_info >= (3, 13):  # pragma: no cover - newer Pythons
            shm = shared_memory.SharedMemory(name=name, create=False, track=False)  # type: ignore[call-arg]
            if shm.size < size:
                shm.close()
                raise ArenaError(f"segment {name!r} has {shm.size} bytes, expected {size}")
            # Keep a reference so the mapping outlives this frame; we never unlink it.
            return cls(shm.name, capacity, block_bytes, shm.buf[:size], owner=None, mm=shm._mmap)  # type: ignore[attr-defined]
        import _posixshmem  # CPython's own module behind SharedMemory on POSIX

        try:
            fd = _posixshmem.shm_open("/" + name.lstrip("/"), os.O_RDWR, mode=0o600)
        except FileNotFoundError:
            raise ArenaError(f"no shared-memory segment {name!r} (is the store running?)") from None
        try:
            have = os.fstat(fd).st_size
            if have < size:
                raise ArenaError(f"segment {name!r} has {have} bytes, expected {size}")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(name, capacity, block_bytes, memoryview(mm), owner=None, mm=mm)

    # ---------------------------------------------------------------- access

    def slot(self, i: int) -> memoryview:
        """Writable view of slot ``i``."""
        if not 0 <= i < self.capacity:
            raise IndexError(f"slot {i} outside 0..{self.capacity - 1}")
        start = i * self.block_bytes
        return self.buf[start : start + self.block_bytes]

    def span(self, i: int, offset: int, length: int) -> memoryview:
        """Bytes ``[offset, offset + length)`` of slot ``i``."""
        if not 0 <= i < self.capacity:
            raise IndexError(f"slot {i} outside 0..{self.capacity - 1}")
        if offset < 0 or length < 0 or offset + length > self.block_bytes:
            raise IndexError(f"span {offset}+{length} outside a {self.block_bytes}-byte slot")
        start = i * self.block_bytes + offset
        return self.buf[start : start + length]

    def spans(self, slots: list[int], offset: int, length: int) -> list[memoryview]:
        """Views of the same span of each slot, adjacent spans merged into one view.

        Whole slots that are numbered consecutively are contiguous in the arena, so a
        run of them becomes a single view (one frame on the wire, one memcpy)."""
        for i in slots:
            if not 0 <= i < self.capacity:
                raise IndexError(f"slot {i} outside 0..{self.capacity - 1}")
        if offset < 0 or length < 0 or offset + length > self.block_bytes:
            raise IndexError(f"span {offset}+{length} outside a {self.block_bytes}-byte slot")
        bb = self.block_bytes
        out: list[memoryview] = []
        run_start = run_end = -1
        for i in slots:
            start = i * bb + offset
            if start == run_end and length == bb:
                run_end += length
                continue
            if run_end > run_start:
                out.append(self.buf[run_start:run_end])
            run_start, run_end = start, start + length
        if run_end > run_start:
            out.append(self.buf[run_start:run_end])
        return out

    def prefault(self) -> None:
        """Map every page now rather than on first touch (a page fault per 4 KiB costs more
        than the copy into it), before anything is served: MADV_POPULATE_WRITE where the
        kernel has it, else the creator writes zeros (the arena is zeros anyway)."""
        mm = self._map()
        if mm is not None and prefault.populate(mm):
            return
        if self._owner is not None:
            zeros = bytes(1 << 20)
            for start in range(0, self.size, len(zeros)):
                n = min(len(zeros), self.size - start)
                self.buf[start : start + n] = zeros[:n]

    def populates(self) -> bool:
        """Whether the kernel maps pages on advice (:meth:`populate` does anything)."""
        mm = self._map()
        return mm is not None and prefault.supported(mm)

    async def populate(self) -> bool:
        """What :meth:`prefault` does, a chunk per turn of the event loop, while the
        arena is in use (services.common.prefault); no zeros written, so nothing written
        meanwhile is lost. Whether it got to the end (not once the arena is closed)."""
        mm = self._map()
        return mm is not None and await prefault.populate_async(mm)

    def _map(self) -> mmap.mmap | None:
        if self._closed:
            return None
        return self._owner._mmap if self._owner is not None else self._mm  # type: ignore[attr-defined]

    # ---------------------------------------------------------------- close

    def close(self) -> None:
        """Unmap. If views are still exported (a zero-copy frame in flight, a worker's slot
        view), the mapping is left to the process's exit instead of raising."""
        if self._closed:
            return
        self._closed = True
        for attempt in range(2):
            try:
                self.buf.release()
                if self._owner is not None:
                    self._owner.close()
                elif self._mm is not None:
                    self._mm.close()
                return
            except BufferError:
                if attempt == 0:
                    gc.collect()  # views held only by garbage cycles
        if self._owner is not None:  # keep SharedMemory.__del__ from retrying noisily
            self._owner._buf = None  # type: ignore[attr-defined]
            self._owner._mmap = None  # type: ignore[attr-defined]

    def unlink(self) -> None:
        """Remove the segment name (creator only); attached mappings stay valid."""
        if self._owner is None:
            raise ArenaError("only the creating store unlinks its arena")
        try:
            self._owner.unlink()
        except FileNotFoundError:
            pass
