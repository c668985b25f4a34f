"""What a store's collaborators share: the block pool, the arena, the block geometry.

:class:`~services.store.node.server.StoreService` builds one :class:`StoreCore` and hands
it to tiering, objects and replication instead of itself, so none of them reaches
into the service (or imports it). KV events need no handle here: the pool queues
them and the service collects them in one place, its ``on_change`` hook (see
:mod:`services.store.pool.block_pool`).
"""

from dataclasses import dataclass

from services.common.clock import Clock
from services.store.arena import Arena
from services.store.pool.block_pool import BlockPool


@dataclass
class StoreCore:
    """What a store's tiering, objects and replication share: pool, arena and geometry."""

    node: str
    epoch: int  # start time in ns: transaction ids and object versions count from it
    pool: BlockPool
    block_size: int  # tokens per block
    block_bytes: int  # bytes per block (one arena slot)
    clock: Clock
    arena: Arena | None = None  # the shared-memory arena, once the service started

    def spans(self, slots: list[int]) -> list[memoryview]:
        """Whole-block views of ``slots`` in the arena."""
        assert self.arena is not None, "the store has not started"
        return self.arena.spans(slots, 0, self.block_bytes)
