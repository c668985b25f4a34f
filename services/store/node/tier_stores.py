"""Where a tier's bytes are: the DRAM arena, SSD files, GPU memory, or plain memory.

Each store answers ``read_into(slot, dst)`` and ``write(slot, src)`` for whole blocks;
:func:`execute` runs a pool's Moves in order through them.

SSD layout under ``--ssd-dir``: ``blocks.bin`` (slot ``i`` at ``i * block_bytes``,
sparse) and ``index.msgpack``: which hash is in which slot, the block's CRC32 and,
for a pinned context-cache block, until when (wall clock) it stays pinned; and the
objects whose blocks are all on SSD (key, size, block hashes) with the set of SSD
blocks that belong to objects, so that the object table and the blocks it names are
saved in one atomic step. The index is rewritten atomically (temp file + rename)
after write-backs; a block whose bytes do not match its CRC at load time is dropped,
so an index that is older than the data (a crash between the two) loses blocks,
never serves wrong ones.
"""

import os
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec
import numpy as np
import structlog

from services.store.arena import Arena
from services.store.pool.tier_policy import Move, Tier
from services.transfer.backends.contract import crc32

log = structlog.get_logger()


class TierStore(ABC):
    """Whole blocks of one tier, read and written by slot."""

    tier: Tier

    @abstractmethod
    def read_into(self, slot: int, dst: memoryview) -> None: ...

    @abstractmethod
    def write(self, slot: int, src: memoryview) -> None: ...

    def close(self) -> None:
        return None


class ArenaStore(TierStore):
    """DRAM's blocks: the shared-memory arena."""

    tier = Tier.DRAM

    def __init__(self, arena: Arena) -> None:
        self.arena = arena

    def read_into(self, slot: int, dst: memoryview) -> None:
        dst[:] = self.arena.slot(slot)

    def write(self, slot: int, src: memoryview) -> None:
        self.arena.slot(slot)[:] = src


class MemoryStore(TierStore):
    """Plain process memory (tests; a stand-in for a GPU where there is none)."""

    def __init__(self, tier: Tier, capacity: int, block_bytes: int) -> None:
        self.tier = tier
        self.bb = block_bytes
        self.buf = memoryview(bytearray(capacity * block_bytes))

    def read_into(self, slot: int, dst: memoryview) -> None:
        dst[:] = self.buf[slot * self.bb : (slot + 1) * self.bb]

    def write(self, slot: int, src: memoryview) -> None:
        self.buf[slot * self.bb : (slot + 1) * self.bb] = src


def vram_available() -> tuple[bool, str]:
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, "torch.cuda.is_available() is False (no GPU)"
    return True, ""


class VramStore(TierStore):
    """GPU memory's blocks: one CUDA tensor of slots."""

    tier = Tier.VRAM

    def __init__(self, capacity: int, block_bytes: int, device: str = "cuda") -> None:
        import torch

        self.torch = torch
        self.bb = block_bytes
        self.t = torch.empty((capacity, block_bytes), dtype=torch.uint8, device=device)

    def read_into(self, slot: int, dst: memoryview) -> None:
        out = self.torch.from_numpy(np.frombuffer(dst, dtype=np.uint8))
        out.copy_(self.t[slot])

    def write(self, slot: int, src: memoryview) -> None:
        self.t[slot].copy_(self.torch.from_numpy(np.frombuffer(src, dtype=np.uint8).copy()))


class _Entry(msgspec.Struct, array_like=True):
    block_hash: int
    slot: int
    crc: int
    pinned_until: float | None = None  # wall clock (time.time())


class _Object(msgspec.Struct, array_like=True):
    key: str
    size: int
    hashes: list[int]


class _Index(msgspec.Struct):
    block_bytes: int
    capacity: int
    saved_at: float
    entries: list[_Entry]
    objects: list[_Object] = []  # (fields added later default, so older indexes load)
    object_blocks: list[int] = []


@dataclass
class SsdState:
    """What a previous run left: blocks (hash, slot, pinned until) whose bytes still
    match, the objects it saved (key, size, hashes) and which blocks were objects'."""

    entries: list[tuple[int, int, float | None]] = field(default_factory=list)
    objects: list[tuple[str, int, list[int]]] = field(default_factory=list)
    object_blocks: set[int] = field(default_factory=set)


class SsdStore(TierStore):
    """SSD's blocks: one sparse file of slots and an index that survives a restart."""

    tier = Tier.SSD

    def __init__(self, directory: str, capacity: int, block_bytes: int) -> None:
        os.makedirs(directory, exist_ok=True)
        self.dir = directory
        self.capacity = capacity
        self.bb = block_bytes
        self.path = os.path.join(directory, "blocks.bin")
        self.index_path = os.path.join(directory, "index.msgpack")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        if os.fstat(self.fd).st_size < capacity * block_bytes:
            os.ftruncate(self.fd, capacity * block_bytes)
        self.crcs: dict[int, int] = {}  # slot -> crc of what was written there

    def read_into(self, slot: int, dst: memoryview) -> None:
        n = os.preadv(self.fd, [dst], slot * self.bb)
        if n != self.bb:
            raise OSError(f"short read of SSD slot {slot}: {n} of {self.bb} bytes")

    def write(self, slot: int, src: memoryview) -> None:
        off = slot * self.bb
        view = memoryview(src)
        while len(view):
            n = os.pwrite(self.fd, view, off)
            view, off = view[n:], off + n
        self.crcs[slot] = crc32(src)

    def save_index(
        self,
        entries: list[tuple[int, int, float | None]],
        objects: Iterable[tuple[str, int, list[int]]] = (),
        object_blocks: Iterable[int] = (),
    ) -> None:
        """Persist (hash, slot, pinned until as wall clock or None) for clean blocks, and
        the objects (key, size, hashes) whose blocks are among them."""
        kept = [
            _Entry(h, s, self.crcs.get(s, 0), until) for h, s, until in entries if s in self.crcs
        ]
        on = {e.block_hash for e in kept}
        idx = _Index(
            block_bytes=self.bb,
            capacity=self.capacity,
            saved_at=time.time(),
            entries=kept,
            objects=[_Object(k, n, list(hs)) for k, n, hs in objects if all(h in on for h in hs)],
            object_blocks=sorted(h for h in object_blocks if h in on),
        )
        tmp = self.index_path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(msgspec.msgpack.encode(idx))
        os.replace(tmp, self.index_path)

    def load_index(self) -> list[tuple[int, int, float | None]]:
        """The blocks a previous run left whose bytes still match their CRC."""
        return self.load_state().entries

    def load_state(self) -> SsdState:
        """The blocks a previous run left whose bytes still match their CRC, and its
        objects (the caller keeps those whose blocks all came back)."""
        try:
            with open(self.index_path, "rb") as f:
                idx = msgspec.msgpack.decode(f.read(), type=_Index)
        except FileNotFoundError:
            return SsdState()
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
            log.warning("ssd_index_unreadable", path=self.index_path, error=str(e))
            return SsdState()
        if idx.block_bytes != self.bb:
            log.warning("ssd_index_mismatch", have=idx.block_bytes, want=self.bb)
            return SsdState()
        out = []
        buf = memoryview(bytearray(self.bb))
        dropped = 0
        for e in idx.entries:
            if not 0 <= e.slot < self.capacity:
                dropped += 1
                continue
            self.read_into(e.slot, buf)
            if crc32(buf) != e.crc:
                dropped += 1
                continue
            self.crcs[e.slot] = e.crc
            out.append((e.block_hash, e.slot, e.pinned_until))
        if dropped:
            log.warning("ssd_blocks_dropped", count=dropped, reason="crc or slot mismatch")
        return SsdState(
            out, [(o.key, o.size, list(o.hashes)) for o in idx.objects], set(idx.object_blocks)
        )

    def wipe(self) -> None:
        self.crcs.clear()
        self.save_index([])

    def close(self) -> None:
        os.close(self.fd)


def execute(moves: list[Move], stores: dict[Tier, TierStore], block_bytes: int) -> None:
    """Run Moves in order (a DRAM end is read or written in place)."""
    tmp: memoryview | None = None
    for m in moves:
        src, dst = stores[m.src], stores[m.dst]
        if isinstance(src, ArenaStore):
            dst.write(m.dst_slot, src.arena.slot(m.src_slot))
        elif isinstance(dst, ArenaStore):
            src.read_into(m.src_slot, dst.arena.slot(m.dst_slot))
        else:
            tmp = tmp or memoryview(bytearray(block_bytes))
            src.read_into(m.src_slot, tmp)
            dst.write(m.dst_slot, tmp)
