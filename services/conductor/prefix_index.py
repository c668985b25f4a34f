"""The conductor's shadow prefix index: which node holds which KV block, rebuilt from
the stores' KV events (paper §5.3: the nodes are the authority, this is a copy used
only to score placements).

Pure: no I/O, no clock. The service feeds it :class:`EventBatch` es and dump pages.

Layout: ``hash -> holders``, only the nodes that hold the block (a handful after
replication), never a slot per node of the cluster: one node id (an int), a tuple of up
to :data:`SMALL` ids, or a set beyond. Matching a request walks its chained block
hashes once, keeping the nodes that still match and intersecting them with each
block's holders from the smaller side (set operations: no Python step per node); it
stops as soon as no node still matches, and returns the nodes grouped by length as well
(:class:`Matches`). A match costs O(sum over the matched blocks of min(nodes still
matching, holders)): the prompt's own holders, independent of the number of indexed blocks and of the nodes in
the cluster, and so does a block's memory (issue 27: a bitmask per block cost
nodes/30 machine words each, 7.9 GB at 4,096 nodes and 10M blocks).

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

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from bus_schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

# Batches kept per node while a dump is outstanding; beyond this the node is simply
# re-dumped (the buffer only exists to bridge the dump's round trip).
MAX_BUFFERED_BATCHES = 10_000

# Holders kept as a tuple up to this many (a membership test walks it), a set beyond:
# a tuple of 2-3 ids is a quarter of a set's memory, and most blocks have 1-3 holders.
SMALL = 8

Holders = int | tuple[int, ...] | set[int]


class Matches(dict[str, int]):
    """node -> prefix length in blocks (what :meth:`PrefixIndex.match` returns), with
    ``by_length``: length -> the nodes matching that many blocks. The placement reads
    the groups (a few lengths) instead of walking every holder of a prefix that many
    nodes hold."""

    def __init__(self) -> None:
        super().__init__()
        self.by_length: dict[int, list[str]] = {}

    @classmethod
    def of(cls, lengths: Mapping[str, int]) -> "Matches":
        """The matches ``lengths`` gives (nodes with a length of at least 1)."""
        out = cls()
        for node, n in lengths.items():
            if n > 0:
                out[node] = n
                out.by_length.setdefault(n, []).append(node)
        return out

    def _add(self, nodes: list[str], length: int) -> None:
        self.update(dict.fromkeys(nodes, length))
        self.by_length[length] = nodes


@dataclass
class _Node:
    id: int
    epoch: int = 0
    seq: int = 0  # last applied sequence number (0: nothing yet)
    blocks: set[int] = field(default_factory=set)
    resyncing: bool = False
    buffer: list[EventBatch] = field(default_factory=list)


class PrefixIndex:
    """Which node holds which KV block, as the stores' events say: a copy to score placements."""

    def __init__(self) -> None:
        self._holders: dict[int, Holders] = {}
        self._nodes: dict[str, _Node] = {}
        self._by_id: dict[int, str] = {}
        self._free_ids: list[int] = []
        self._next_id = 0

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
        return len(self._holders)

    def holders(self, block_hash: int) -> frozenset[str]:
        """The nodes holding ``block_hash``."""
        v = self._holders.get(block_hash)
        if v is None:
            return frozenset()
        ids = (v,) if isinstance(v, int) else v
        return frozenset(self._by_id[i] for i in ids)

    def match(self, block_hashes: Sequence[int]) -> "Matches":
        """Prefix length in blocks per node, for nodes holding at least the first block
        (a dict, with the same nodes grouped by length in ``by_length``). The per-node
        work is done by set operations and ``dict.fromkeys`` (no Python step per node):
        a prefix every node of a large cluster holds costs little per node."""
        out = Matches()
        if not block_hashes:
            return out
        holders = self._holders
        first = holders.get(block_hashes[0])
        if first is None:
            return out
        # Never mutated below (each change makes a new set), so the first block's own
        # holder set can stand for the nodes still matching until one drops out.
        alive: set[int] | frozenset[int] = (
            frozenset((first,)) if isinstance(first, int) else frozenset(first)
        )
        name = self._by_id.__getitem__
        total = len(block_hashes)
        prev: Holders = first
        for i in range(1, total):
            v = holders.get(block_hashes[i])
            if v is prev or v == prev:
                continue  # the holders of the block before: those still matching hold it
            if v is None:
                still: set[int] | frozenset[int] = frozenset()
            elif isinstance(v, int):
                if v in alive:
                    if len(alive) == 1:
                        continue
                    still = frozenset((v,))
                else:
                    still = frozenset()
            else:
                still = alive.intersection(v)
            if len(still) != len(alive):
                out._add(list(map(name, alive.difference(still) if still else alive)), i)
                if not still:
                    return out
                alive = still
            prev = v  # type: ignore[assignment]  # not None here: None ends the match
        out._add(list(map(name, alive)), total)
        return out

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
        for h in hashes:
            if h not in n.blocks:
                n.blocks.add(h)
                self._add(h, n.id)
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
        del self._by_id[n.id]
        self._free_ids.append(n.id)

    # ---------------------------------------------------------------- internals

    def _add_node(self, node: str) -> _Node:
        if self._free_ids:
            nid = self._free_ids.pop()
        else:
            nid = self._next_id
            self._next_id += 1
        n = _Node(id=nid)
        self._nodes[node] = n
        self._by_id[nid] = node
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
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                for h in ev.block_hashes:
                    if h not in n.blocks:
                        n.blocks.add(h)
                        self._add(h, n.id)
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    if h in n.blocks:
                        n.blocks.discard(h)
                        self._remove(h, n.id)
            elif isinstance(ev, AllBlocksCleared):
                self._clear(n)

    def _add(self, h: int, nid: int) -> None:
        """``nid`` now holds ``h`` (it did not: its node's block set says so)."""
        holders = self._holders
        v = holders.get(h)
        if v is None:
            holders[h] = nid
        elif isinstance(v, int):
            holders[h] = (v, nid)
        elif isinstance(v, tuple):
            holders[h] = v + (nid,) if len(v) < SMALL else {*v, nid}
        else:
            v.add(nid)

    def _remove(self, h: int, nid: int) -> None:
        """``nid`` no longer holds ``h`` (it did)."""
        holders = self._holders
        v = holders[h]
        if isinstance(v, int):
            del holders[h]
        elif isinstance(v, tuple):
            at = v.index(nid)
            rest = v[:at] + v[at + 1 :]
            if len(rest) > 1:
                holders[h] = rest
            elif rest:
                holders[h] = rest[0]
            else:
                del holders[h]
        else:
            v.discard(nid)
            if len(v) <= SMALL // 2:  # back to a tuple, with room before the next set
                holders[h] = tuple(v)

    def _clear(self, n: _Node) -> None:
        for h in n.blocks:
            self._remove(h, n.id)
        n.blocks = set()
