"""The block pool's lower tiers (VRAM, SSD): the hooks :class:`BlockPool` calls (pure).

:class:`~services.store.pool.block_pool.BlockPool` keeps DRAM's books and the transactions;
this base class keeps what lies below DRAM and answers the pool's hooks:

* ``_below(h)``: the lower tier holding a prefix hit, to promote it into DRAM;
* ``_make_room(need)``: frees DRAM slots: an LRU victim is demoted where a lower tier
  can take it (else gone: BlockRemoved), a pinned block only its pin holds is
  offloaded to SSD when nothing unpinned is left;
* ``_written(h)``: a block committed into DRAM, queued for write-back to SSD;
* ``_pin_below`` / ``_unpin_below``: a context-cache pin holds the SSD copy too;
* ``writebacks()`` / ``writeback_done()``: the asynchronous DRAM -> SSD copies;
  ``restore()`` / ``ssd_entries()``: the SSD index across restarts.

With no lower tier every hook is trivial: victims leave the node, nothing is
promoted, offloaded or written back. That is the simulator's pool, and the live
store's without ``--ssd-dir`` or a GPU. Data never moves here: hooks queue
:class:`Move` s, which the owner takes (``take_moves()``) and runs, in order, before
it touches the pool again (see :mod:`services.store.pool.tier_policy` for the lifecycle).
"""

import functools
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

from bus_schemas.kv_events import BlockRemoved, BlockStored, KVEvent
from services.common.clock import Clock
from services.store.pool.eviction import LRUEviction
from services.store.pool.tier_policy import Move, Tier, TierIndex

TIER_COUNTERS = ("demoted", "promoted", "offloaded", "writebacks", "lower_evictions", "cleared")
F = TypeVar("F", bound=Callable[..., Any])


def operation(fn: F) -> F:
    """A public operation of the pool: when it returns (or raises), the pool's owner is
    told (``on_change``) so it runs the queued moves and publishes the queued events in
    the same synchronous step; nobody else has to remember to."""

    @functools.wraps(fn)
    def run(self: "LowerTiers", *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        finally:
            self._changed()

    return run  # type: ignore[return-value]


class FreeList(Protocol):
    """The pool's free DRAM slots: a deque, or the live store's
    :class:`~services.store.node.fence.SlotFence` (which fences a slot freed under a transfer)."""

    def append(self, slot: int, /) -> None: ...

    def popleft(self) -> int: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[int]: ...


class LowerTiers:
    """The block pool's hooks for the tiers below DRAM: promote, demote, offload, drop."""

    # DRAM's books and helpers, kept by BlockPool (declared here for the reader).
    _free: "FreeList"
    _cached: dict[int, int]
    _refs: dict[int, int]
    _lru: LRUEviction[int]
    _pins: dict[int, float]
    _pin_heap: list[tuple[float, int, int]]
    _events: list[KVEvent]
    counters: dict[str, int]

    clock: Clock

    def _lock(self, h: int) -> None: ...
    def _unlock(self, h: int) -> None: ...
    def _pin(self, h: int, until: float) -> None: ...
    def _queue(self, event: KVEvent) -> None: ...
    def _changed(self) -> None: ...

    def _init_lower(self, vram_capacity: int, ssd_capacity: int, writeback: bool) -> None:
        self.lower: list[TierIndex] = []
        if vram_capacity > 0:
            self.lower.append(TierIndex(Tier.VRAM, vram_capacity))
        if ssd_capacity > 0:
            self.lower.append(TierIndex(Tier.SSD, ssd_capacity))
        self.ssd = next((t for t in self.lower if t.tier == Tier.SSD), None)
        self.writeback = writeback and self.ssd is not None
        self._moves: list[Move] = []
        self._wb_queue: deque[int] = deque()
        self._wb_inflight: dict[int, int] = {}
        self.ssd_dirty = False  # the SSD index changed (the service persists it)

    # ------------------------------------------------------------------ queries

    def on_node(self, h: int) -> bool:
        if h in self._cached:
            return True
        for t in self.lower:  # a loop, not any(): this runs per block of every request
            if h in t:
                return True
        return False

    def where(self, h: int) -> list[Tier]:
        out = [Tier.DRAM] if h in self._cached else []
        return out + [t.tier for t in self.lower if h in t]

    def node_blocks(self) -> set[int]:
        out = set(self._cached)
        for t in self.lower:
            out.update(t.slots)
        return out

    def take_moves(self) -> list[Move]:
        out, self._moves = self._moves, []
        return out

    def ssd_entries(self) -> list[tuple[int, int, float | None]]:
        """Clean SSD blocks: (hash, SSD slot, pinned until or None)."""
        if self.ssd is None:
            return []
        return [
            (h, s, self._pins.get(h)) for h, s in self.ssd.slots.items() if h not in self.ssd.held
        ]

    def writeback_pending(self) -> int:
        """Write-backs queued or on their way to the SSD."""
        return len(self._wb_queue) + len(self._wb_inflight)

    def _lower_stats(self, s: dict[str, int]) -> None:
        for t in self.lower:
            name = t.tier.name.lower()
            s[f"{name}_capacity_blocks"] = t.capacity
            s[f"{name}_blocks"] = len(t)
            s[f"{name}_pinned_blocks"] = len(t.pinned)
        s["writeback_queued"] = len(self._wb_queue)
        s["writeback_inflight"] = len(self._wb_inflight)

    # ------------------------------------------------------------------ hooks of the pool

    def _below(self, h: int) -> TierIndex | None:
        """The lower tier a block not in DRAM is on (None: not on the node)."""
        return next((t for t in self.lower if h in t), None)

    def _promote(self, h: int, t: TierIndex) -> None:
        """``h`` (held on ``t``) gets a fresh DRAM slot, copied up by a Move."""
        slot = self._free.popleft()
        self._moves.append(Move(h, t.tier, t.slots[h], Tier.DRAM, slot))
        self._cached[h] = slot
        t.settle(h)
        if h in self._pins:
            self._lock(h)  # the pin's hold on the DRAM copy
        self.counters["promoted"] += 1

    def _written(self, h: int) -> None:
        """``h`` was just cached in DRAM: its SSD copy is due (write-back)."""
        if h in self._pins:
            self._lock(h)
        if self.writeback and self.ssd is not None and h not in self.ssd:
            self._wb_queue.append(h)

    def _pin_below(self, h: int) -> None:
        if self.ssd is not None and h in self.ssd:
            self.ssd.pin(h)

    def _unpin_below(self, h: int) -> None:
        if self.ssd is not None and h in self.ssd:
            self.ssd.unpin(h)

    def _offload_candidates(self) -> list[int]:
        if self.ssd is None:
            return []
        c = [h for h in self._pins if h in self._cached and self._refs.get(h) == 1]
        return sorted(c, key=lambda h: (self._pins[h], h))

    def _offloadable(self) -> int:
        ssd = self.ssd
        if ssd is None:
            return 0
        cands = self._offload_candidates()
        with_copy = sum(1 for h in cands if h in ssd)
        return with_copy + min(len(cands) - with_copy, ssd.room())

    def _room(self) -> int:
        """DRAM slots a request can have: free, evictable, offloadable."""
        return len(self._free) + len(self._lru) + self._offloadable()

    def _make_room(self, need: int) -> None:
        """Free DRAM slots until ``need`` are free (the caller checked ``_room()``);
        blocks that leave the node are queued as one BlockRemoved."""
        removed: list[int] = []
        while len(self._free) < need:
            if len(self._lru):
                h = self._lru.victim()
                slot = self._cached.pop(h)
                self._free.append(slot)
                if self.lower:
                    self._demote(h, slot, removed)
                else:  # no tier below: it leaves the node
                    removed.append(h)
                    self.counters["evictions"] += 1
                continue
            ssd = self.ssd
            assert ssd is not None
            cands = self._offload_candidates()
            h = next((c for c in cands if c in ssd), cands[0])
            slot = self._cached.pop(h)
            del self._refs[h]  # the pin's hold on the DRAM copy
            self._free.append(slot)
            if h not in ssd:
                s = self._reserve(ssd, h, removed)
                self._moves.append(Move(h, Tier.DRAM, slot, Tier.SSD, s))
                ssd.settle(h)
                self.ssd_dirty = True
            ssd.pin(h)
            self.counters["offloaded"] += 1
        if removed:
            self._queue(BlockRemoved(block_hashes=removed))

    def _demote(self, h: int, slot: int, removed: list[int]) -> None:
        if any(h in t for t in self.lower):
            return  # a lower copy exists: only the DRAM copy goes
        for t in self.lower:
            if t.room() > 0:
                s = self._reserve(t, h, removed)
                self._moves.append(Move(h, Tier.DRAM, slot, t.tier, s))
                t.settle(h)
                self.counters["demoted"] += 1
                if t is self.ssd:
                    self.ssd_dirty = True
                return
        removed.append(h)
        self.counters["evictions"] += 1

    def _reserve(self, t: TierIndex, h: int, removed: list[int]) -> int:
        """A slot of tier ``t`` for ``h`` (held until settled), evicting ``t``'s LRU victim
        if need be; the victim cascades to a later tier or leaves the node."""
        if t.free:
            s = t.free.popleft()
        else:
            v = t.lru.victim()
            s = t.slots.pop(v)
            self.counters["lower_evictions"] += 1
            if t is self.ssd:
                self.ssd_dirty = True
            if not self.on_node(v):
                later = self.lower[self.lower.index(t) + 1 :]
                for t2 in later:
                    if t2.room() > 0:
                        s2 = self._reserve(t2, v, removed)
                        self._moves.append(Move(v, t.tier, s, t2.tier, s2))
                        t2.settle(v)
                        break
                else:
                    removed.append(v)
                    self.counters["evictions"] += 1
        t.place(h, s)
        return s

    # ------------------------------------------------------------------ write-back

    @operation
    def writebacks(self, max_n: int = 64) -> list[Move]:
        """Start up to ``max_n`` write-backs DRAM -> SSD: each block is locked in DRAM and
        its SSD slot held until ``writeback_done``. Blocks the SSD evicted for them go
        as BlockRemoved."""
        ssd = self.ssd
        if ssd is None:
            return []
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
        if removed:
            self._queue(BlockRemoved(block_hashes=removed))
        return moves

    @operation
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

    @operation
    def restore(self, entries: list[tuple[int, int, float | None]]) -> list[int]:
        """Load SSD blocks a previous run left: (hash, SSD slot, pinned until or None);
        returns those loaded (BlockStored)."""
        ssd = self.ssd
        if ssd is None:
            return []
        now = self.clock.now()
        loaded: list[int] = []
        for h, slot, until in entries:
            if h in ssd or slot not in ssd.free or not 0 <= slot < ssd.capacity:
                continue
            ssd.free.remove(slot)
            ssd.place(h, slot)
            ssd.settle(h)
            if until is not None and until > now:
                self._pin(h, until)
            loaded.append(h)
        if loaded:
            self._queue(BlockStored(block_hashes=loaded))
        return loaded
