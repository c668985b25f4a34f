"""Slot generations in shared memory: a same-host writer reads the fence's verdict itself.

A copy into a peer store's arena over shared memory is checked by nobody on the peer's
side; the writer used to learn whether its bytes landed in live slots from the CLOSE
verdict, a round trip to the peer (~0.6-0.9 ms here, a third of a 17 MiB ship). The
peer's :class:`~services.store.node.fence.SlotFence` keeps its per-slot generations in a
segment of its own instead (:class:`OwnGens`, int64 per slot, named in GRANTED as
``gens_shm``), so the writer compares them after its copy with those its grant saw
(:class:`PeerGens`): unchanged means the slots were never freed while the bytes moved.

Why that is the verdict: a grant keeps its slots busy until its CLOSE, so a slot freed
(generation bumped) after the check stays parked, never handed on and never read, as
when the transaction is aborted after an accepted CLOSE; one freed before or during the
copy shows a new generation, so the ship fails ``fenced``. An 8-byte aligned store is
seen whole by another process on the platforms we run on, and the reader only compares.
"""

import mmap
import os
from collections import OrderedDict
from collections.abc import Sequence
from multiprocessing import shared_memory

MAX_PEERS = 64


def unchanged(view: Sequence[int], slots: list[int], gens: list[int]) -> bool | None:
    """Whether ``view`` (a store's generations) still has ``gens`` at ``slots``; None
    when it does not cover them."""
    if len(slots) != len(gens):
        return None
    try:
        return all(view[s] == g for s, g in zip(slots, gens, strict=True))
    except IndexError:
        return None


class OwnGens:
    """The store's segment: ``view`` is what the fence writes (zeros at start)."""

    def __init__(self, arena_name: str, capacity: int) -> None:
        self._shm = shared_memory.SharedMemory(
            name=f"{arena_name}_gen", create=True, size=8 * capacity
        )
        self.name = self._shm.name
        buf = self._shm.buf
        assert buf is not None  # open until close()
        self.view = buf[: 8 * capacity].cast("q")

    def close(self) -> None:
        self.view.release()
        self._shm.close()
        try:
            self._shm.unlink()
        except FileNotFoundError:
            pass


class PeerGens:
    """Peers' segments mapped read-only, the most recently used ``MAX_PEERS`` kept."""

    def __init__(self, max_peers: int = MAX_PEERS) -> None:
        self._maps: OrderedDict[str, tuple[mmap.mmap, memoryview]] = OrderedDict()
        self.max_peers = max_peers

    def unchanged(self, name: str, slots: list[int], gens: list[int]) -> bool | None:
        """Whether ``slots`` still have ``gens`` in segment ``name``; None when that cannot
        be told here (no such segment on this host, or it does not cover the slots)."""
        if not name:
            return None
        view = self._view(name)
        return None if view is None else unchanged(view, slots, gens)

    def _view(self, name: str) -> memoryview | None:
        got = self._maps.get(name)
        if got is not None:
            self._maps.move_to_end(name)
            return got[1]
        import _posixshmem  # CPython's module behind SharedMemory: no resource tracker

        try:
            fd = _posixshmem.shm_open("/" + name.lstrip("/"), os.O_RDONLY, mode=0o600)
        except OSError:
            return None
        try:
            size = os.fstat(fd).st_size
            if size < 8:
                return None
            mm = mmap.mmap(fd, size - size % 8, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        view = memoryview(mm).cast("q")
        self._maps[name] = (mm, view)
        while len(self._maps) > self.max_peers:
            self._drop(next(iter(self._maps)))
        return view

    def _drop(self, name: str) -> None:
        mm, view = self._maps.pop(name)
        view.release()
        mm.close()

    def close(self) -> None:
        for name in list(self._maps):
            self._drop(name)
