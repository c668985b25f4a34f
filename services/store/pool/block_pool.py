"""A node's block metadata: which slot holds which block, who holds it, what goes next.

Pure: no I/O, time from an injected :class:`~services.common.clock.Clock`. The live
store (:mod:`services.store.node.server`) and the simulator (:mod:`perigee.sim.cluster`)
build this same class; the live store may give it lower tiers (VRAM, SSD: the hooks
of :class:`~services.store.pool.lower_tiers.LowerTiers`), the simulator gives it none.

Lifecycle of a DRAM slot::

    FREE --allocate--> TX-OWNED (new block of an open transaction; writable)
    TX-OWNED --commit (full, hashed, not ephemeral, hash not cached yet)--> CACHED
    TX-OWNED --commit (tail / ephemeral / duplicate) | abort | lease expiry--> FREE
    CACHED, locked (refs > 0: a transaction's prefix hit, a context-cache pin, a write-back)
    CACHED, unlocked --> in the LRU --victim to make room--> FREE
                         (demoted to a lower tier, or gone from the node: BlockRemoved)

A transaction (``TxAllocate``):

* PREFILL / DECODE: ``hit_blocks`` = longest prefix of ``block_hashes`` on the node;
  those blocks are locked (a hit on a lower tier is first promoted into a fresh DRAM
  slot). Fresh slots are allocated for the remaining full blocks and the partial
  tail, so ``len(slots) == ceil(num_tokens / block_size)``. Room is made by evicting
  unlocked blocks, least recently used first; if that is not enough the request is
  refused (``capacity``) and nothing changes.
* SOURCE: every block in ``block_hashes`` must be on the node (else ``missing``);
  they are locked so another node can pull them. ``slots`` are theirs, nothing new.

Commit caches the new full blocks under their hashes (unless retention is
EPHEMERAL) and emits ``BlockStored``; a block whose hash was cached meanwhile by
another transaction is a duplicate and its slot is freed, as is the tail slot.
Locks are released last block first, so a chain's tail is evicted before its head
(vLLM does the same). CONTEXT_CACHE pins the request's blocks for
``context_ttl_s``: pinned blocks are locked until the pin expires.
Abort frees the new slots and releases the locks; ``expire()`` aborts every
transaction whose lease has run out and drops expired pins.

KV events: the pool queues them as it goes, like vLLM's ``BlockPool``
(``take_events()``); after every public operation it calls ``on_change`` (when set),
where its owner runs the queued tier moves and publishes the events, one batch per
operation. Objects (``put_blocks``) take slots without a transaction.
"""

import heapq
import math
import secrets
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from bus_schemas.control import Refused, TxAllocate, TxDone, TxRole
from bus_schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from bus_schemas.requests import Retention
from services.common.clock import Clock
from services.common.hashing import num_blocks
from services.store.pool.eviction import LRUEviction
from services.store.pool.lower_tiers import TIER_COUNTERS, FreeList, LowerTiers, operation
from services.store.pool.tier_policy import TierIndex

# Decode write-back (issue 24): answer blocks stored, and later hits on them by tier
# (not the SSD tier's write-back, whose counters are writeback_*).
ANSWER_COUNTERS = (
    "answer_blocks",
    "answer_hits_vram",
    "answer_hits_dram",
    "answer_hits_ssd",
)


@dataclass(frozen=True)
class Allocation:
    """A granted transaction: ``slots[i]`` holds block ``i`` of the request."""

    tx_id: str
    slots: list[int]
    hit_blocks: int


@dataclass
class _Tx:
    tx_id: str
    request_id: str
    role: TxRole
    retention: Retention
    context_ttl_s: float
    deadline: float
    hashes: list[int]  # the request's full-block hashes
    slots: list[int]
    hit_blocks: int
    writable: frozenset[int] = field(default_factory=frozenset)  # slots allocated by this tx
    readable: frozenset[int] = field(default_factory=frozenset)  # every slot of this tx
    answer: bool = False  # a decode worker's answer blocks (TxAllocate.answer)


class BlockPool(LowerTiers):
    """A node's block metadata: slots, transactions, holders, LRU and pins (DRAM's books)."""

    def __init__(
        self,
        capacity: int,
        block_size: int,
        clock: Clock,
        id_prefix: str = "tx-",
        random_ids: bool = False,
        *,
        vram_capacity: int = 0,
        ssd_capacity: int = 0,
        writeback: bool = True,
        kv_events: bool = True,
    ) -> None:
        if capacity <= 0 or block_size <= 0:
            raise ValueError("capacity and block_size must be positive")
        self.capacity = capacity
        self.block_size = block_size
        self.clock = clock
        self.id_prefix = id_prefix
        self.random_ids = random_ids  # tx ids end in 64 random bits (not guessable)
        self.kv_events = kv_events  # False: nobody reads them (nothing is queued)
        self.on_change: Callable[[], None] | None = None
        self._events: list[KVEvent] = []
        self._next_id = 1
        self._free: FreeList = deque(range(capacity))
        self._cached: dict[int, int] = {}  # block hash -> DRAM slot
        self._refs: dict[int, int] = {}  # block hash -> lock count (absent = 0)
        self._lru: LRUEviction[int] = LRUEviction()
        self._pins: dict[int, float] = {}  # block hash -> pinned until
        # (until, -n, hash): pins ending together are released last pinned first, so a
        # chain (pinned head to tail) goes back to the LRU tail first, as commit's locks
        # do, and its tail is evicted before its head.
        self._pin_heap: list[tuple[float, int, int]] = []
        self._pins_made = 0
        self._txs: dict[str, _Tx] = {}
        self._lease_heap: list[tuple[float, str]] = []
        self._tx_owned = 0
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "tx_allocated",
                "tx_refused",
                "tx_committed",
                "tx_aborted",
                "tx_expired",
                "hit_blocks",
                "new_blocks",
                "stored_blocks",
                "duplicate_blocks",
                "evictions",
                "unpinned_blocks",
                *TIER_COUNTERS,
                *ANSWER_COUNTERS,
            ),
            0,
        )
        # Blocks a decode worker wrote back (answers) while they are on the node, so
        # hits on them are counted by tier.
        self._answers: set[int] = set()
        self._init_lower(vram_capacity, ssd_capacity, writeback)

    def use_free_list(self, free: FreeList) -> None:
        """Keep free DRAM slots in ``free`` (``append`` / ``popleft`` / ``len``): the live
        store's :class:`~services.store.node.fence.SlotFence`, through which every freed slot
        passes so that a transfer still open on it fences it. ``free`` must hold exactly
        the slots that are free now."""
        if sorted(free) != sorted(self._free):
            raise ValueError("the new free list must hold exactly the slots free now")
        self._free = free

    # ------------------------------------------------------------------ events

    def take_events(self) -> list[KVEvent]:
        """The KV events queued since the last call, oldest first."""
        out, self._events = self._events, []
        return out

    def _queue(self, event: KVEvent) -> None:
        if self._answers:
            if isinstance(event, AllBlocksCleared):
                self._answers.clear()
            elif isinstance(event, BlockRemoved):
                self._answers.difference_update(event.block_hashes)
        if self.kv_events:
            self._events.append(event)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    # ------------------------------------------------------------------ queries

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.capacity - len(self._free)

    @property
    def cached_blocks(self) -> int:
        """Blocks on the node (any tier)."""
        return len(self.node_blocks()) if self.lower else len(self._cached)

    @property
    def evictable_blocks(self) -> int:
        return len(self._lru)

    def is_cached(self, block_hash: int) -> bool:
        """On the node, in any tier."""
        return self.on_node(block_hash)

    def slot_of(self, block_hash: int) -> int | None:
        return self._cached.get(block_hash)

    def lock_count(self, block_hash: int) -> int:
        return self._refs.get(block_hash, 0)

    def eviction_order(self) -> list[int]:
        """Evictable DRAM block hashes, next victim first."""
        return list(self._lru)

    def prefix_hits(self, block_hashes: list[int]) -> int:
        """How many leading blocks are on the node (no locking)."""
        n = 0
        cached, lower = self._cached, self.lower
        for h in block_hashes:
            if h not in cached and not (lower and self.on_node(h)):
                break
            n += 1
        return n

    def open_txs(self) -> list[str]:
        return list(self._txs)

    def tx_slots(self, tx_id: str) -> list[int] | None:
        tx = self._txs.get(tx_id)
        return None if tx is None else list(tx.slots)

    def check_write(self, tx_id: str, slots: list[int]) -> str | None:
        """Why ``slots`` may not be written for ``tx_id`` (None when they may)."""
        tx = self._txs.get(tx_id)
        if tx is None:
            return f"unknown or closed transaction {tx_id!r}"
        bad = [s for s in slots if s not in tx.writable]
        return f"slots {bad[:8]} are not new blocks of {tx_id}" if bad else None

    def check_read(self, tx_id: str, slots: list[int]) -> str | None:
        """Why ``slots`` may not be read for ``tx_id`` (None when they may)."""
        tx = self._txs.get(tx_id)
        if tx is None:
            return f"unknown or closed transaction {tx_id!r}"
        bad = [s for s in slots if s not in tx.readable]
        return f"slots {bad[:8]} do not belong to {tx_id}" if bad else None

    def dump(self, cursor: int = 0, limit: int = 50_000) -> tuple[list[int], int | None]:
        """Hashes on the node ``>= cursor`` in ascending order, at most ``limit``; the
        cursor of the next page (None on the last). Hash-keyed, so pages stay valid as
        blocks come and go between calls."""
        limit = max(1, limit)
        rest = sorted(h for h in self.node_blocks() if h >= cursor)
        page = rest[:limit]
        return page, (page[-1] + 1 if len(rest) > limit else None)

    def stats(self) -> dict[str, int]:
        s = {
            "capacity_blocks": self.capacity,
            "free_blocks": len(self._free),
            "used_blocks": self.used_blocks,
            "cached_blocks": self.cached_blocks,
            "dram_cached_blocks": len(self._cached),
            "evictable_blocks": len(self._lru),
            "locked_blocks": len(self._refs),
            "pinned_blocks": len(self._pins),
            "tx_owned_blocks": self._tx_owned,
            "open_txs": len(self._txs),
            **self.counters,
        }
        self._lower_stats(s)
        return s

    # ------------------------------------------------------------------ transactions

    @operation
    def allocate(self, req: TxAllocate, tx_id: str | None = None) -> Allocation | Refused:
        """Open a transaction (see module doc); evictions it causes are queued events."""
        new_id = self._new_tx_id(req, tx_id)
        if isinstance(new_id, Refused):
            return new_id
        hashes = list(req.block_hashes)
        if req.role == TxRole.SOURCE:
            for i, h in enumerate(hashes):
                if not self.on_node(h):
                    self.counters["tx_refused"] += 1
                    return Refused(
                        reason="missing", message=f"block {i} ({h:#x}) is not on this node"
                    )
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
                t = self._below(h)
                assert t is not None
                t.hold(h)
                promote[h] = t
        need_new = total - hit
        need = need_new + len(promote)
        room = self._room()
        if need > room:
            self._unwind(hits, promote)
            self.counters["tx_refused"] += 1
            free, lru = len(self._free), len(self._lru)
            have = (
                f"{free} free, {lru} evictable and {room - free - lru} offloadable"
                if self.lower
                else f"{free} free and {lru} evictable"
            )
            return Refused(
                reason="capacity",
                message=f"need {need} free blocks, have {have} of {self.capacity}",
            )
        self._make_room(need)
        for h, t in promote.items():
            self._promote(h, t)
        for h in hits:
            if h in promote:
                self._lock(h)
        new = [self._free.popleft() for _ in range(need_new)]
        self._tx_owned += need_new
        slots = [self._cached[h] for h in hits] + new
        self._open(req, new_id, hashes, slots, hit, writable=frozenset(new))
        if self._answers and not req.answer:  # a writer extending its chain is no reuse
            self._count_answer_hits(hits, promote)
        self.counters["hit_blocks"] += hit if req.role != TxRole.SOURCE else 0
        self.counters["new_blocks"] += need_new
        return Allocation(tx_id=new_id, slots=slots, hit_blocks=hit)

    @operation
    def commit(self, tx_id: str, request_id: str = "") -> TxDone | Refused:
        tx = self._take_tx(tx_id, request_id)
        if isinstance(tx, Refused):
            return tx
        stored: list[int] = []
        if tx.role == TxRole.SOURCE:
            self._rollback(tx)
        else:
            keep = tx.retention != Retention.EPHEMERAL
            newly: set[int] = set()  # block indices this commit cached
            for i in range(tx.hit_blocks, len(tx.slots)):
                slot = tx.slots[i]
                h = tx.hashes[i] if i < len(tx.hashes) else None
                self._tx_owned -= 1
                if h is not None and keep and h not in self._cached:
                    if not (self.lower and self.on_node(h)):
                        stored.append(h)
                    self._cached[h] = slot  # new, or the DRAM copy of a lower-tier block
                    newly.add(i)
                    if self.lower or self._pins:
                        self._written(h)
                else:
                    if h is not None and keep:
                        self.counters["duplicate_blocks"] += 1
                    self._free.append(slot)
            if tx.answer and newly:
                self._answers.update(tx.hashes[i] for i in newly)
                self.counters["answer_blocks"] += len(newly)
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
        if stored:
            self._queue(BlockStored(block_hashes=stored))
        return TxDone(tx_id=tx_id, stored_blocks=len(stored))

    @operation
    def abort(self, tx_id: str) -> TxDone | Refused:
        tx = self._txs.pop(tx_id, None)
        if tx is None:
            return self._unknown(tx_id)
        self._rollback(tx)
        self.counters["tx_aborted"] += 1
        return TxDone(tx_id=tx_id)

    def renew(self, tx_id: str, lease_s: float) -> bool:
        """Move ``tx_id``'s lease end to now + ``lease_s`` (never earlier than it was);
        False when no such transaction is open."""
        tx = self._txs.get(tx_id)
        if tx is None or not (lease_s > 0 and math.isfinite(lease_s)):
            return False
        deadline = self.clock.now() + lease_s
        if deadline > tx.deadline:
            tx.deadline = deadline
            heapq.heappush(self._lease_heap, (deadline, tx_id))
        return True

    @operation
    def expire(self, now: float | None = None) -> list[str]:
        """Abort every transaction whose lease ended at or before ``now`` and drop expired
        context-cache pins; returns the aborted transaction ids, oldest lease first."""
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
            until, _, h = heapq.heappop(self._pin_heap)
            if self._pins.get(h) != until:
                continue
            self._unpin(h)
            self.counters["unpinned_blocks"] += 1
        return expired

    # ------------------------------------------------------------------ objects, wipe, remove

    @operation
    def put_blocks(
        self, hashes: list[int], retention: Retention = Retention.DEFAULT, writeback: bool = True
    ) -> list[int] | Refused:
        """Fresh DRAM slots for new blocks ``hashes`` (none of them on the node), cached at
        once: the caller fills them in the same synchronous step (no transaction, so no
        other call can come between). EPHEMERAL blocks are refused (nothing would keep
        them)."""
        if retention == Retention.EPHEMERAL:
            return Refused(reason="bad_request", message="ephemeral objects are not kept")
        if len(set(hashes)) != len(hashes) or any(self.on_node(h) for h in hashes):
            return Refused(reason="bad_request", message="blocks already on the node")
        need = len(hashes)
        room = self._room()
        if need > room:
            self.counters["tx_refused"] += 1
            return Refused(reason="capacity", message=f"need {need} free blocks, have {room}")
        self._make_room(need)
        slots = [self._free.popleft() for _ in range(need)]
        for h, slot in zip(hashes, slots, strict=True):
            self._cached[h] = slot
            self._lru.add(h)
            if writeback and self.writeback and self.ssd is not None:
                self._wb_queue.append(h)
        self.counters["stored_blocks"] += need
        self._queue(BlockStored(block_hashes=list(hashes)))
        return slots

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

    @operation
    def clear(self) -> list[int]:
        """Drop every block that no transaction (or write-back) holds, pins included;
        returns them. Event: AllBlocksCleared when nothing is left, else BlockRemoved."""
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
            self._queue(AllBlocksCleared())
        elif removed:
            self._queue(BlockRemoved(block_hashes=removed))
        return removed

    @operation
    def remove(self, hashes: list[int]) -> tuple[list[int], list[int]]:
        """Drop the given blocks from every tier; returns (removed, busy). A block in use
        (locked by a transaction or a write-back) is left alone and reported busy."""
        removed: list[int] = []
        busy: list[int] = []
        for h in dict.fromkeys(hashes):
            if not self.on_node(h):
                continue
            if self._refs.get(h, 0) > (1 if h in self._pins else 0) or any(
                h in t.held for t in self.lower
            ):
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
            self._queue(BlockRemoved(block_hashes=removed))
        return removed, busy

    # ------------------------------------------------------------------ internals

    def _new_tx_id(self, req: TxAllocate, tx_id: str | None) -> "str | Refused":
        """The id of a transaction about to open, or why the request is refused."""
        bad = self._validate(req)
        if bad is None and tx_id is not None and tx_id in self._txs:
            bad = f"transaction {tx_id!r} exists"
        if bad is not None:
            self.counters["tx_refused"] += 1
            return Refused(reason="bad_request", message=bad)
        if tx_id is None:
            tx_id = f"{self.id_prefix}{self._next_id}"
            if self.random_ids:
                tx_id += f"-{secrets.token_hex(8)}"
            self._next_id += 1
        return tx_id

    def _take_tx(self, tx_id: str, request_id: str) -> "_Tx | Refused":
        """Remove and return an open transaction, or say why it cannot be closed."""
        tx = self._txs.get(tx_id)
        if tx is None:
            return self._unknown(tx_id)
        if request_id and request_id != tx.request_id:
            return Refused(
                reason="bad_request",
                message=f"{tx_id} belongs to request {tx.request_id!r}, not {request_id!r}",
            )
        del self._txs[tx_id]
        return tx

    def _validate(self, req: TxAllocate) -> str | None:
        if not (req.lease_s > 0 and math.isfinite(req.lease_s)):
            return f"lease_s must be a positive number, got {req.lease_s}"
        if req.role == TxRole.SOURCE:
            return None
        if req.num_tokens <= 0:
            return f"num_tokens must be positive, got {req.num_tokens}"
        full = req.num_tokens // self.block_size
        if len(req.block_hashes) > full:
            return (
                f"{len(req.block_hashes)} block hashes for {req.num_tokens} tokens "
                f"(at most {full} full blocks of {self.block_size})"
            )
        if not math.isfinite(req.context_ttl_s) or req.context_ttl_s < 0:
            return f"context_ttl_s must be >= 0, got {req.context_ttl_s}"
        return None

    def _open(
        self,
        req: TxAllocate,
        tx_id: str,
        hashes: list[int],
        slots: list[int],
        hit: int,
        writable: frozenset[int],
    ) -> None:
        deadline = self.clock.now() + req.lease_s
        self._txs[tx_id] = _Tx(
            tx_id=tx_id,
            request_id=req.request_id,
            role=req.role,
            retention=req.retention,
            context_ttl_s=req.context_ttl_s,
            deadline=deadline,
            hashes=hashes,
            slots=slots,
            hit_blocks=hit,
            writable=writable,
            readable=frozenset(slots),
            answer=req.answer,
        )
        heapq.heappush(self._lease_heap, (deadline, tx_id))
        self.counters["tx_allocated"] += 1

    def _rollback(self, tx: _Tx) -> None:
        for slot in tx.slots[tx.hit_blocks :]:
            self._free.append(slot)
            self._tx_owned -= 1
        for h in reversed(tx.hashes[: tx.hit_blocks]):
            self._unlock(h)

    def _unwind(self, hits: list[int], promote: dict[int, TierIndex]) -> None:
        """Undo a refused allocation's locks and holds."""
        for h in reversed(hits):
            if h not in promote:
                self._unlock(h)
        for h, t in promote.items():
            t.settle(h)

    def _count_answer_hits(self, hits: list[int], promote: dict[int, TierIndex]) -> None:
        """Hits (a prefix locked for reuse or for a pull) on written-back blocks, by the
        tier each was found in."""
        for h in hits:
            if h in self._answers:
                tier = promote[h].tier.name.lower() if h in promote else "dram"
                self.counters[f"answer_hits_{tier}"] += 1

    def _unknown(self, tx_id: str) -> Refused:
        if not tx_id.startswith(self.id_prefix):
            return Refused(reason="epoch", message=f"{tx_id!r} is not from this store's epoch")
        return Refused(reason="unknown_tx", message=f"no open transaction {tx_id!r}")

    def _lock(self, h: int) -> None:
        n = self._refs.get(h, 0)
        if n == 0:
            self._lru.remove(h)
        self._refs[h] = n + 1

    def _unlock(self, h: int) -> None:
        n = self._refs[h] - 1
        if n:
            self._refs[h] = n
        else:
            del self._refs[h]
            self._lru.add(h)

    def _pin(self, h: int, until: float) -> None:
        old = self._pins.get(h)
        if old is not None and old >= until:
            return
        if old is None:
            if h in self._cached:
                self._lock(h)
            self._pin_below(h)
        self._pins[h] = until
        self._pins_made += 1
        heapq.heappush(self._pin_heap, (until, -self._pins_made, h))

    def _unpin(self, h: int) -> None:
        del self._pins[h]
        if h in self._cached:
            self._unlock(h)
        self._unpin_below(h)
