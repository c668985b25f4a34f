"""BlockPool over tiers: DRAM slots as before, plus VRAM / SSD behind them (pure).

Same transaction contract as :class:`~services.store.block_pool.BlockPool` (which it
extends; with no lower tier it behaves exactly like it), with these differences:

* a prefix hit may be on a lower tier: the block is promoted into a fresh DRAM slot
  for the transaction (a :class:`Move`), counted in the room the request needs;
* making room demotes instead of dropping where a lower tier can take the block, and
  offloads pinned context-cache blocks to SSD when nothing unpinned is left (see
  :mod:`services.store.tiers.policy` for the whole lifecycle);
* committed blocks are queued for asynchronous write-back to SSD; a block being
  written back is locked in DRAM;
* write-back, wipe, removal, restore and the objects' no-transaction path live in
  :class:`~services.store.tiers.upkeep.PoolUpkeep`.

Every operation's data movement is queued as Moves; the service calls ``take_moves()``
right after and runs them, in order, before any other pool call.
"""

import heapq
from collections import deque

from bus_schemas.control import Refused, TxAllocate, TxDone, TxRole
from bus_schemas.kv_events import BlockRemoved, BlockStored, KVEvent
from bus_schemas.requests import Retention
from services.common.clock import Clock
from services.common.hashing import num_blocks
from services.store.block_pool import Allocation, BlockPool
from services.store.tiers.policy import Move, Tier, TierIndex
from services.store.tiers.upkeep import PoolUpkeep


class TieredBlockPool(PoolUpkeep, BlockPool):
    def __init__(
        self,
        capacity: int,
        block_size: int,
        clock: Clock,
        id_prefix: str = "tx-",
        *,
        vram_capacity: int = 0,
        ssd_capacity: int = 0,
        writeback: bool = True,
    ) -> None:
        super().__init__(capacity, block_size, clock, id_prefix)
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
        for k in ("demoted", "promoted", "offloaded", "writebacks", "lower_evictions", "cleared"):
            self.counters[k] = 0

    # ------------------------------------------------------------------ queries

    def on_node(self, h: int) -> bool:
        return h in self._cached or any(h in t for t in self.lower)

    def where(self, h: int) -> list[Tier]:
        out = [Tier.DRAM] if h in self._cached else []
        return out + [t.tier for t in self.lower if h in t]

    def is_cached(self, block_hash: int) -> bool:
        return self.on_node(block_hash)

    def node_blocks(self) -> set[int]:
        out = set(self._cached)
        for t in self.lower:
            out.update(t.slots)
        return out

    @property
    def cached_blocks(self) -> int:
        return len(self.node_blocks()) if self.lower else len(self._cached)

    def prefix_hits(self, block_hashes: list[int]) -> int:
        n = 0
        for h in block_hashes:
            if not self.on_node(h):
                break
            n += 1
        return n

    def dump(self, cursor: int = 0, limit: int = 50_000) -> tuple[list[int], int | None]:
        limit = max(1, limit)
        rest = sorted(h for h in self.node_blocks() if h >= cursor)
        page = rest[:limit]
        return page, (page[-1] + 1 if len(rest) > limit else None)

    def stats(self) -> dict[str, int]:
        s = super().stats()
        s["cached_blocks"] = self.cached_blocks
        s["dram_cached_blocks"] = len(self._cached)
        for t in self.lower:
            name = t.tier.name.lower()
            s[f"{name}_capacity_blocks"] = t.capacity
            s[f"{name}_blocks"] = len(t)
            s[f"{name}_pinned_blocks"] = len(t.pinned)
        s["writeback_queued"] = len(self._wb_queue)
        s["writeback_inflight"] = len(self._wb_inflight)
        return s

    def take_moves(self) -> list[Move]:
        out, self._moves = self._moves, []
        return out

    def ssd_entries(self) -> list[tuple[int, int, float | None]]:
        """Clean SSD blocks: (hash, SSD slot, pinned until or None)."""
        if self.ssd is None:
            return []
        return [(h, s, self._pins.get(h)) for h, s in self.ssd.slots.items()
                if h not in self.ssd.held]

    # ------------------------------------------------------------------ transactions

    def allocate(
        self, req: TxAllocate, tx_id: str | None = None
    ) -> tuple[Allocation | Refused, list[KVEvent]]:
        tx_id = self._new_tx_id(req, tx_id)
        if isinstance(tx_id, Refused):
            return tx_id, []
        hashes = list(req.block_hashes)
        if req.role == TxRole.SOURCE:
            for i, h in enumerate(hashes):
                if not self.on_node(h):
                    self.counters["tx_refused"] += 1
                    return Refused(reason="missing", message=f"block {i} ({h:#x}) is not on this node"), []
            hit = total = len(hashes)
        else:
            hit = self.prefix_hits(hashes)
            total = num_blocks(req.num_tokens, self.block_size)
        hits = hashes[:hit]
        promote: dict[int, TierIndex] = {}
        for h in hits:
            if h in self._cached:
                self._lock(h)
            elif h not in promote:
                t = next(t for t in self.lower if h in t)
                t.hold(h)
                promote[h] = t
        need_new = total - hit
        need = need_new + len(promote)
        room = len(self._free) + len(self._lru) + self._offloadable()
        if need > room:
            self._unwind(hits, promote)
            self.counters["tx_refused"] += 1
            return Refused(
                reason="capacity",
                message=(f"need {need} free blocks, have {len(self._free)} free, {len(self._lru)} "
                         f"evictable and {room - len(self._free) - len(self._lru)} offloadable "
                         f"of {self.capacity}"),
            ), []
        removed = self._make_room(need)
        for h, t in promote.items():
            slot = self._free.popleft()
            self._moves.append(Move(h, t.tier, t.slots[h], Tier.DRAM, slot))
            self._cached[h] = slot
            t.settle(h)
            if h in self._pins:
                self._lock(h)  # the pin's hold on the DRAM copy
            self.counters["promoted"] += 1
        for h in hits:
            if h in promote:
                self._lock(h)
        new = [self._free.popleft() for _ in range(need_new)]
        self._tx_owned += need_new
        slots = [self._cached[h] for h in hits] + new
        self._open(req, tx_id, hashes, slots, hit, writable=frozenset(new))
        self.counters["hit_blocks"] += hit if req.role != TxRole.SOURCE else 0
        self.counters["new_blocks"] += need_new
        events: list[KVEvent] = [BlockRemoved(block_hashes=removed)] if removed else []
        return Allocation(tx_id=tx_id, slots=slots, hit_blocks=hit), events

    def commit(self, tx_id: str, request_id: str = "") -> tuple[TxDone | Refused, list[KVEvent]]:
        tx = self._take_tx(tx_id, request_id)
        if isinstance(tx, Refused):
            return tx, []
        stored: list[int] = []
        if tx.role == TxRole.SOURCE:
            self._rollback(tx)
        else:
            keep = tx.retention != Retention.EPHEMERAL
            newly: set[int] = set()
            for i in range(tx.hit_blocks, len(tx.slots)):
                slot = tx.slots[i]
                h = tx.hashes[i] if i < len(tx.hashes) else None
                self._tx_owned -= 1
                if h is not None and keep and h not in self._cached:
                    if not self.on_node(h):
                        stored.append(h)
                    self._cached[h] = slot  # new, or the DRAM copy of a lower-tier block
                    newly.add(i)
                    if h in self._pins:
                        self._lock(h)
                    if self.writeback and self.ssd is not None and h not in self.ssd:
                        self._wb_queue.append(h)
                else:
                    if h is not None and keep:
                        self.counters["duplicate_blocks"] += 1
                    self._free.append(slot)
            if tx.retention == Retention.CONTEXT_CACHE and tx.context_ttl_s > 0:
                until = self.clock.now() + tx.context_ttl_s
                for h in tx.hashes:
                    if self.on_node(h):
                        self._pin(h, until)
            for i in reversed(range(len(tx.hashes))):
                h = tx.hashes[i]
                if i < tx.hit_blocks:
                    self._unlock(h)
                elif i in newly and h not in self._refs:
                    self._lru.add(h)
        self.counters["tx_committed"] += 1
        self.counters["stored_blocks"] += len(stored)
        events: list[KVEvent] = [BlockStored(block_hashes=stored)] if stored else []
        return TxDone(tx_id=tx_id, stored_blocks=len(stored)), events

    def expire(self, now: float | None = None) -> list[str]:
        now = self.clock.now() if now is None else now
        expired: list[str] = []
        while self._lease_heap and self._lease_heap[0][0] <= now:
            deadline, tx_id = heapq.heappop(self._lease_heap)
            tx = self._txs.get(tx_id)
            if tx is None or tx.deadline != deadline:
                continue
            del self._txs[tx_id]
            self._rollback(tx)
            self.counters["tx_expired"] += 1
            expired.append(tx_id)
        while self._pin_heap and self._pin_heap[0][0] <= now:
            until, h = heapq.heappop(self._pin_heap)
            if self._pins.get(h) != until:
                continue
            self._unpin(h)
            self.counters["unpinned_blocks"] += 1
        return expired

    # ------------------------------------------------------------------ internals

    def _pin(self, h: int, until: float) -> None:
        old = self._pins.get(h)
        if old is not None and old >= until:
            return
        if old is None:
            if h in self._cached:
                self._lock(h)
            if self.ssd is not None and h in self.ssd:
                self.ssd.pin(h)
        self._pins[h] = until
        heapq.heappush(self._pin_heap, (until, h))

    def _unpin(self, h: int) -> None:
        del self._pins[h]
        if h in self._cached:
            self._unlock(h)
        if self.ssd is not None and h in self.ssd:
            self.ssd.unpin(h)

    def _unwind(self, hits: list[int], promote: dict[int, TierIndex]) -> None:
        for h in reversed(hits):
            if h not in promote:
                self._unlock(h)
        for h, t in promote.items():
            t.settle(h)

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

    def _make_room(self, need: int) -> list[int]:
        removed: list[int] = []
        while len(self._free) < need:
            if len(self._lru):
                h = self._lru.victim()
                slot = self._cached.pop(h)
                self._free.append(slot)
                self._demote(h, slot, removed)
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
        return removed

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
