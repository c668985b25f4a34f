"""Which block lives in which tier, and what moves when (pure; the simulator can reuse it).

Tiers, fastest first: DRAM (the shared-memory arena; every transaction reads and
writes there), then the *lower* tiers in order: VRAM (when a GPU is there) and SSD
(files, the only one that survives a restart). A block is *on the node* while any
tier holds it; BlockStored / BlockRemoved events are about the node, not a tier.

Lifecycle of a cached block::

    committed into DRAM --queued--> write-back (async, DRAM locked) --> also on SSD (clean)
    DRAM pressure: LRU DRAM victim --has a lower copy--> DRAM copy dropped (still on node)
                                   --no copy, a lower tier has room--> demoted (a Move)
                                   --no lower room--> gone (BlockRemoved)
    lower-tier pressure: that tier's LRU victim cascades to the next tier, or is gone
    allocate / SOURCE hit on a block not in DRAM --> promoted (a Move into a fresh DRAM
                                   slot; the lower copy stays)

Retention (paper §5.2): EPHEMERAL blocks are never cached. CONTEXT_CACHE blocks are
pinned for their TTL: never gone while pinned; under DRAM pressure, when the LRU has
nothing left, a pinned block that only its pin holds is *offloaded* to SSD (its DRAM
copy dropped) instead of being evicted; on SSD a pinned block is not evictable. A
block held by an open transaction or a write-back never leaves DRAM.

Data never moves here: operations return :class:`Move` s (``take_moves()``) that the
service executes, in order, before it touches the pool again.
"""

from collections import deque
from dataclasses import dataclass
from enum import IntEnum

from services.store.pool.eviction import LRUEviction


class Tier(IntEnum):
    """A storage tier, fastest first."""

    VRAM = 0
    DRAM = 1
    SSD = 2


@dataclass(frozen=True)
class Move:
    """One block copied from a slot of one tier to a slot of another."""

    block_hash: int
    src: Tier
    src_slot: int
    dst: Tier
    dst_slot: int


class TierIndex:
    """One lower tier: ``capacity`` slots, which block is in which, and eviction order.

    A block here is *held* (being written or read by a Move in flight), *pinned*
    (context cache) or evictable (in the LRU)."""

    def __init__(self, tier: Tier, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("tier capacity must be positive")
        self.tier = tier
        self.capacity = capacity
        self.free: deque[int] = deque(range(capacity))
        self.slots: dict[int, int] = {}
        self.lru: LRUEviction[int] = LRUEviction()
        self.pinned: set[int] = set()
        self.held: dict[int, int] = {}

    def __contains__(self, h: object) -> bool:
        return h in self.slots

    def __len__(self) -> int:
        return len(self.slots)

    def room(self) -> int:
        return len(self.free) + len(self.lru)

    def hold(self, h: int) -> None:
        self.lru.remove(h)
        self.held[h] = self.held.get(h, 0) + 1

    def settle(self, h: int) -> None:
        n = self.held.get(h, 0) - 1
        if n > 0:
            self.held[h] = n
            return
        self.held.pop(h, None)
        if h in self.slots and h not in self.pinned:
            self.lru.add(h)

    def pin(self, h: int) -> None:
        self.pinned.add(h)
        self.lru.remove(h)

    def unpin(self, h: int) -> None:
        self.pinned.discard(h)
        if h in self.slots and h not in self.held:
            self.lru.add(h)

    def place(self, h: int, slot: int) -> None:
        """``h`` now owns ``slot`` (held until settled)."""
        self.slots[h] = slot
        self.held[h] = self.held.get(h, 0) + 1

    def drop(self, h: int) -> int | None:
        slot = self.slots.pop(h, None)
        if slot is None:
            return None
        self.lru.remove(h)
        self.pinned.discard(h)
        self.held.pop(h, None)
        self.free.append(slot)
        return slot
