"""Simulated nodes: each has a store (the real :class:`BlockPool` with LRU eviction)
and one NIC link; their KV events feed the conductor's real :class:`PrefixIndex`.

A node's store sees exactly the transaction sequence the live conductor and workers
send it (paper §5.3)::

    compute     TxAllocate PREFILL on the prefill node, DECODE on the decode node,
    start       SOURCE on the holder when a remote prefix is pulled (never while the
                request queues; services.common.reservation reads the answers)
    first token TxCommit on the prefill node and the holder (the holder's commit only
                releases its locks); the decode node commits when it loads the KV
    failure     TxAbort on every transaction of the request

The pool queues its KV events; after each operation its ``on_change`` hook (as in the
live store) wraps them in an :class:`EventBatch` with the node's next sequence number
and applies it to the index at once (the bus has no latency here).

A :class:`Link` is a FIFO bandwidth server: one transfer at a time at the cost
model's NIC bandwidth (``cost.transfer_time``, so ``speedup`` scales it too).
"""

from dataclasses import dataclass, field

from bus_schemas.control import Refused, TxAllocate, TxRole
from bus_schemas.kv_events import EventBatch, KVEvent
from services.common.clock import Clock
from services.common.cost_model import CostModel
from services.conductor.prefix_index import PrefixIndex
from services.store.pool.block_pool import Allocation, BlockPool

LEASE_S = 1e12  # nothing expires in the simulator: every transaction is closed explicitly


@dataclass
class Link:
    """A node's NIC in the simulator: when it is free and what it has moved."""

    cost: CostModel
    free_at: float = 0.0
    bytes_moved: float = 0.0
    busy_s: float = 0.0

    def transfer(self, tokens: int, earliest: float) -> float:
        """Move the KV of ``tokens`` starting no earlier than ``earliest``; returns the
        time the last byte lands."""
        if tokens <= 0:
            return earliest
        dur = self.cost.transfer_time(tokens)
        start = max(earliest, self.free_at)
        self.free_at = start + dur
        self.bytes_moved += self.cost.kv_bytes(tokens)
        self.busy_s += dur
        return self.free_at

    def ship_overlapped(
        self, tokens: int, compute_start: float, compute_end: float, layers: int
    ) -> float:
        """Layer-wise streaming (paper §3.1 step 3): layer i's KV leaves while layer i+1
        computes, so only the last layer's share trails the compute; the link is held
        for the transfer's duration, as late as the overlap allows."""
        if tokens <= 0:
            return compute_end
        dur = self.cost.transfer_time(tokens)
        tail = dur / max(1, layers)
        start = max(self.free_at, compute_start, compute_end + tail - dur)
        end = start + dur
        self.free_at = max(self.free_at, end)
        self.bytes_moved += self.cost.kv_bytes(tokens)
        self.busy_s += dur
        return end


@dataclass
class Node:
    """A simulated node: its store's block pool, its link and its role."""

    name: str
    pool: BlockPool | None  # None: no store (KV goes straight to HBM, nothing cached)
    link: Link
    seq: int = 0
    role: str = ""  # a Role (a P/D controller may flip it)


@dataclass
class Cluster:
    """The simulated nodes, their stores and the prefix index their KV events feed."""

    cost: CostModel
    clock: Clock
    block_size: int
    index: PrefixIndex = field(default_factory=PrefixIndex)
    nodes: dict[str, Node] = field(default_factory=dict)
    epoch: int = 1

    def add_node(self, name: str, cache_tokens: int, role: str) -> Node:
        blocks = cache_tokens // self.block_size
        pool = (
            BlockPool(blocks, self.block_size, self.clock, id_prefix=f"{name}-")
            if blocks > 0
            else None
        )
        node = Node(name, pool, Link(self.cost), role=role)
        if pool is not None:
            pool.on_change = lambda: self._publish(node, pool.take_events())
        self.nodes[name] = node
        return node

    def _publish(self, node: Node, events: list[KVEvent]) -> None:
        if not events:
            return
        node.seq += 1
        self.index.apply(
            EventBatch(
                node=node.name, epoch=self.epoch, seq=node.seq, ts=self.clock.now(), events=events
            )
        )

    def allocate(
        self, node_name: str, request_id: str, role: TxRole, hashes: list[int], num_tokens: int
    ) -> Allocation | Refused | None:
        """Open a transaction on ``node_name``'s store; None when the node has no store."""
        node = self.nodes[node_name]
        if node.pool is None:
            return None
        return node.pool.allocate(
            TxAllocate(
                request_id=request_id,
                role=role,
                block_hashes=hashes,
                num_tokens=num_tokens,
                lease_s=LEASE_S,
            )
        )

    def commit(self, node_name: str, tx: Allocation | None) -> None:
        node = self.nodes[node_name]
        if tx is None or node.pool is None:
            return
        node.pool.commit(tx.tx_id)

    def abort(self, node_name: str, tx: Allocation | None) -> None:
        node = self.nodes[node_name]
        if tx is None or node.pool is None:
            return
        node.pool.abort(tx.tx_id)

    def cached_blocks(self) -> int:
        return sum(n.pool.cached_blocks for n in self.nodes.values() if n.pool is not None)
