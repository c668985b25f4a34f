"""The conductor's shadow prefix index: which node holds which KV block, rebuilt from
the stores' KV events (paper §5.3: the nodes are the authority, this is a copy used
only to score placements).

Pure: no I/O, no clock. The service feeds it :class:`EventBatch` es and dump pages.

Layout: ``hash -> int bitmask`` over node indices, so matching a request walks its
chained block hashes once, AND-ing masks, and stops as soon as no node still
matches; cost is O(matched prefix), independent of the number of indexed blocks
and nodes (64 nodes and 1M blocks: one dict lookup per block of the prompt).

Per-node stream state, with the node's recovery lifecycle:

    unknown --batch seq 1 / dump--> synced --next seq--> synced
    synced --gap or unknown node with seq > 1--> resyncing (apply() returns True once:
        the service asks that node for a dump; batches keep being applied best-effort
        and are buffered); begin_resync() enters it on the service's own initiative
    resyncing --replace_node(epoch, seq, hashes)--> synced (buffered batches newer
        than the snapshot are replayed on top of it)
    any --batch with a newer epoch (store restarted)--> node cleared; synced if the
        batch is seq 1, else resyncing
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from bus_schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

# Batches kept per node while a dump is outstanding; beyond this the node is simply
# re-dumped (the buffer only exists to bridge the dump's round trip).
MAX_BUFFERED_BATCHES = 10_000


@dataclass
class _Node:
    bit: int
    epoch: int = 0
    seq: int = 0  # last applied sequence number (0: nothing yet)
    blocks: set[int] = field(default_factory=set)
    resyncing: bool = False
    buffer: list[EventBatch] = field(default_factory=list)


class PrefixIndex:
    """Which node holds which KV block, as the stores' events say: a copy to score placements."""

    def __init__(self) -> None:
        self._masks: dict[int, int] = {}
        self._nodes: dict[str, _Node] = {}
        self._by_bit: dict[int, str] = {}
        self._free_bits: list[int] = []
        self._next_bit = 0

    # ---------------------------------------------------------------- queries

    def nodes(self) -> list[str]:
        return sorted(self._nodes)

    def state(self, node: str) -> tuple[int, int] | None:
        """(epoch, last applied seq) of ``node``, or None if never heard of."""
        n = self._nodes.get(node)
        return None if n is None else (n.epoch, n.seq)

    def resyncing(self, node: str) -> bool:
        n = self._nodes.get(node)
        return n is not None and n.resyncing

    def blocks(self, node: str) -> frozenset[int]:
        n = self._nodes.get(node)
        return frozenset(n.blocks) if n else frozenset()

    def num_blocks(self) -> int:
        """Distinct block hashes held anywhere."""
        return len(self._masks)

    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Prefix length in blocks per node, for nodes holding at least the first block."""
        masks = self._masks
        if not block_hashes:
            return {}
        alive = masks.get(block_hashes[0], 0)
        if not alive:
            return {}
        out: dict[str, int] = {}
        total = len(block_hashes)
        for i in range(1, total):
            m = alive & masks.get(block_hashes[i], 0)
            if m != alive:
                self._record(out, alive & ~m, i)
                if not m:
                    return out
                alive = m
        self._record(out, alive, total)
        return out

    def _record(self, out: dict[str, int], mask: int, length: int) -> None:
        while mask:
            low = mask & -mask
            out[self._by_bit[low.bit_length() - 1]] = length
            mask ^= low

    # ---------------------------------------------------------------- updates

    def apply(self, batch: EventBatch) -> bool:
        """Apply one batch. True means "ask this node for a dump now" (returned once per
        gap; the node stays in resync until :meth:`replace_node` or :meth:`dump_failed`)."""
        n = self._nodes.get(batch.node)
        if n is None:
            n = self._add_node(batch.node)
            n.epoch = batch.epoch
            if batch.seq != 1:
                return self._start_resync(n, batch)
            self._apply_events(n, batch)
            n.seq = batch.seq
            return False
        if batch.epoch < n.epoch:
            return False  # a dead incarnation's late batch
        if n.resyncing:
            # Best effort until the dump lands; replace_node replays what is newer.
            self._buffer(n, batch)
            self._apply_events(n, batch)
            return False
        if batch.epoch > n.epoch:
            self._clear(n)
            n.epoch, n.seq = batch.epoch, 0
            if batch.seq != 1:
                return self._start_resync(n, batch)
            self._apply_events(n, batch)
            n.seq = batch.seq
            return False
        if batch.seq <= n.seq:
            return False  # duplicate, or already contained in the last dump
        if batch.seq != n.seq + 1:
            return self._start_resync(n, batch)
        self._apply_events(n, batch)
        n.seq = batch.seq
        return False

    def begin_resync(self, node: str) -> None:
        """The service is about to fetch a dump of ``node``: buffer its batches from now
        on so that none applied during the dump's round trip is lost."""
        n = self._nodes.get(node) or self._add_node(node)
        if not n.resyncing:
            n.resyncing = True
            n.buffer = []

    def replace_node(self, node: str, epoch: int, seq: int, hashes: Iterable[int]) -> bool:
        """Install a dump taken at (epoch, seq), then replay buffered batches after it.
        Returns True if the view is still not current (ask for another dump)."""
        n = self._nodes.get(node) or self._add_node(node)
        if epoch < n.epoch and not n.resyncing:
            return False  # a stale dump; a newer incarnation is already tracked
        buffered = sorted(
            (b for b in n.buffer if b.epoch == epoch and b.seq > seq), key=lambda b: b.seq
        )
        newer = [b for b in n.buffer if b.epoch > epoch]
        self._clear(n)
        n.epoch, n.seq, n.resyncing, n.buffer = epoch, seq, False, []
        bit = 1 << n.bit
        masks = self._masks
        for h in hashes:
            if h not in n.blocks:
                n.blocks.add(h)
                masks[h] = masks.get(h, 0) | bit
        for b in buffered:
            if b.seq != n.seq + 1:
                return self._start_resync(n, b)
            self._apply_events(n, b)
            n.seq = b.seq
        if newer:  # the store restarted while we were dumping it
            n.resyncing, n.buffer = True, newer
            return True
        return False

    def dump_failed(self, node: str) -> None:
        """The dump could not be fetched: the next batch from ``node`` asks again."""
        n = self._nodes.get(node)
        if n is not None and n.resyncing:
            n.resyncing = False
            n.seq = -1  # no batch can follow -1, so the next one is a gap

    def remove_node(self, node: str) -> None:
        """Forget a node entirely (its store is gone)."""
        n = self._nodes.pop(node, None)
        if n is None:
            return
        self._clear(n)
        del self._by_bit[n.bit]
        self._free_bits.append(n.bit)

    # ---------------------------------------------------------------- internals

    def _add_node(self, node: str) -> _Node:
        if self._free_bits:
            bit = self._free_bits.pop()
        else:
            bit = self._next_bit
            self._next_bit += 1
        n = _Node(bit=bit)
        self._nodes[node] = n
        self._by_bit[bit] = node
        return n

    def _start_resync(self, n: _Node, batch: EventBatch) -> bool:
        n.resyncing = True
        n.buffer = []
        self._buffer(n, batch)
        self._apply_events(n, batch)
        return True

    def _buffer(self, n: _Node, batch: EventBatch) -> None:
        if len(n.buffer) < MAX_BUFFERED_BATCHES:
            n.buffer.append(batch)

    def _apply_events(self, n: _Node, batch: EventBatch) -> None:
        bit = 1 << n.bit
        masks = self._masks
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                for h in ev.block_hashes:
                    if h not in n.blocks:
                        n.blocks.add(h)
                        masks[h] = masks.get(h, 0) | bit
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    if h in n.blocks:
                        n.blocks.discard(h)
                        self._unset(h, bit)
            elif isinstance(ev, AllBlocksCleared):
                self._clear(n)

    def _unset(self, h: int, bit: int) -> None:
        m = self._masks.get(h, 0) & ~bit
        if m:
            self._masks[h] = m
        else:
            self._masks.pop(h, None)

    def _clear(self, n: _Node) -> None:
        bit = 1 << n.bit
        for h in n.blocks:
            self._unset(h, bit)
        n.blocks = set()
