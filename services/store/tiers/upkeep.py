"""The tiered pool's upkeep: write-back, wipe, removal, restore, objects (pure).

A mixin of :class:`~services.store.tiers.pool.TieredBlockPool` (it uses the pool's
books directly); kept apart so that the transaction path stays readable.

* ``writebacks()`` starts DRAM -> SSD copies (the block locked in DRAM, its SSD slot
  held) and ``writeback_done()`` settles them;
* ``clear()`` wipes every block no transaction holds; ``remove()`` drops given blocks;
  ``restore()`` loads the SSD index a previous run left;
* ``put_blocks()`` / ``dram_slots()``: objects' path without transactions (the caller
  copies in the same synchronous step).
"""

from typing import TYPE_CHECKING

from bus_schemas.control import Refused
from bus_schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from bus_schemas.requests import Retention
from services.store.tiers.policy import Move, Tier

if TYPE_CHECKING:
    from services.store.tiers.pool import TieredBlockPool

    _Base = TieredBlockPool
else:
    _Base = object


class PoolUpkeep(_Base):
    # ------------------------------------------------------------------ objects (no tx)

    def put_blocks(self, hashes: list[int], retention: Retention = Retention.DEFAULT,
                   writeback: bool = True) -> tuple[list[int] | Refused, list[KVEvent]]:
        """Fresh DRAM slots for new blocks ``hashes`` (none of them on the node), cached at
        once: the caller fills them in the same synchronous step (no transaction, so no
        other call can come between). EPHEMERAL blocks are refused (nothing would keep
        them)."""
        if retention == Retention.EPHEMERAL:
            return Refused(reason="bad_request", message="ephemeral objects are not kept"), []
        if len(set(hashes)) != len(hashes) or any(self.on_node(h) for h in hashes):
            return Refused(reason="bad_request", message="blocks already on the node"), []
        need = len(hashes)
        room = len(self._free) + len(self._lru) + self._offloadable()
        if need > room:
            self.counters["tx_refused"] += 1
            return Refused(reason="capacity", message=f"need {need} free blocks, have {room}"), []
        removed = self._make_room(need)
        slots = [self._free.popleft() for _ in range(need)]
        for h, slot in zip(hashes, slots, strict=True):
            self._cached[h] = slot
            self._lru.add(h)
            if writeback and self.writeback and self.ssd is not None:
                self._wb_queue.append(h)
        self.counters["stored_blocks"] += need
        events: list[KVEvent] = [BlockRemoved(block_hashes=removed)] if removed else []
        return slots, events + [BlockStored(block_hashes=list(hashes))]

    def dram_slots(self, hashes: list[int]) -> list[int] | None:
        """The DRAM slots of ``hashes`` when all are in DRAM (each counts as used now),
        else None (a SOURCE transaction promotes them). Read them in the same step."""
        slots = []
        for h in hashes:
            s = self._cached.get(h)
            if s is None:
                return None
            slots.append(s)
        for h in hashes:
            if h in self._lru:
                self._lru.add(h)
        return slots

    # ------------------------------------------------------------------ write-back

    def writebacks(self, max_n: int = 64) -> tuple[list[Move], list[KVEvent]]:
        """Start up to ``max_n`` write-backs DRAM -> SSD: each block is locked in DRAM and
        its SSD slot held until ``writeback_done``. Events: blocks the SSD evicted."""
        ssd = self.ssd
        if ssd is None:
            return [], []
        moves: list[Move] = []
        removed: list[int] = []
        while self._wb_queue and len(moves) < max_n:
            h = self._wb_queue[0]
            if h not in self._cached or h in ssd:
                self._wb_queue.popleft()
                continue
            if ssd.room() == 0:
                break
            self._wb_queue.popleft()
            s = self._reserve(ssd, h, removed)
            self._lock(h)
            self._wb_inflight[h] = s
            moves.append(Move(h, Tier.DRAM, self._cached[h], Tier.SSD, s))
        return moves, ([BlockRemoved(block_hashes=removed)] if removed else [])

    def writeback_pending(self) -> int:
        """Write-backs queued or on their way to the SSD."""
        return len(self._wb_queue) + len(self._wb_inflight)

    def writeback_done(self, h: int, ok: bool) -> None:
        ssd = self.ssd
        if h not in self._wb_inflight or ssd is None:
            return
        del self._wb_inflight[h]
        self._unlock(h)
        if ok:
            ssd.settle(h)
            if h in self._pins:
                ssd.pin(h)
            self.counters["writebacks"] += 1
        else:
            ssd.drop(h)
        self.ssd_dirty = True

    # ------------------------------------------------------------------ wipe / remove / restore

    def clear(self) -> tuple[list[int], list[KVEvent]]:
        """Drop every block that no transaction (or write-back) holds, pins included.
        Event: AllBlocksCleared when nothing is left, else BlockRemoved."""
        before = self.node_blocks()
        for h in list(self._pins):
            self._unpin(h)
        self._pin_heap.clear()
        for h in list(self._lru):
            self._lru.remove(h)
            self._free.append(self._cached.pop(h))
        for t in self.lower:
            for h in [h for h in t.slots if h not in t.held]:
                t.drop(h)
        self._wb_queue.clear()
        self.ssd_dirty = True
        removed = sorted(before - self.node_blocks())
        self.counters["cleared"] += len(removed)
        if not self.node_blocks():
            return removed, [AllBlocksCleared()]
        return removed, ([BlockRemoved(block_hashes=removed)] if removed else [])

    def remove(self, hashes: list[int]) -> tuple[list[int], list[int], list[KVEvent]]:
        """Drop the given blocks from every tier; returns (removed, busy, events). A block
        in use (locked by a transaction or a write-back) is left alone and reported busy."""
        removed: list[int] = []
        busy: list[int] = []
        for h in dict.fromkeys(hashes):
            if not self.on_node(h):
                continue
            if self._refs.get(h, 0) > (1 if h in self._pins else 0) or any(
                    h in t.held for t in self.lower):
                busy.append(h)
                continue
            if h in self._pins:
                self._unpin(h)
            if h in self._cached:
                self._lru.remove(h)
                self._free.append(self._cached.pop(h))
            for t in self.lower:
                t.drop(h)
            removed.append(h)
        if removed:
            self.ssd_dirty = True
        return removed, busy, ([BlockRemoved(block_hashes=removed)] if removed else [])

    def restore(self, entries: list[tuple[int, int, float | None]]) -> list[KVEvent]:
        """Load SSD blocks a previous run left: (hash, SSD slot, pinned until or None)."""
        ssd = self.ssd
        if ssd is None:
            return []
        loaded: list[int] = []
        now = self.clock.now()
        for h, slot, until in entries:
            if h in ssd or slot not in ssd.free or not 0 <= slot < ssd.capacity:
                continue
            ssd.free.remove(slot)
            ssd.place(h, slot)
            ssd.settle(h)
            if until is not None and until > now:
                self._pin(h, until)
            loaded.append(h)
        return [BlockStored(block_hashes=loaded)] if loaded else []
