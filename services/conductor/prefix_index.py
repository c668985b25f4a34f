"""The conductor's shadow prefix index: which node holds which KV block, rebuilt from
the stores' KV events (paper §5.3: the nodes are the authority, this is a copy used
only to score placements).

Pure: no I/O, no clock. The service feeds it :class:`EventBatch` es and dump pages.

Layout: ``hash -> holders``, only the nodes that hold the block (a handful after
replication), never a slot per node of the cluster: one node id (an int), a tuple of up
to :data:`SMALL` ids, or beyond that a :class:`_Many` (a frozenset of ids and the
holders' names in order, replaced, never changed, when a holder comes or goes).
Matching a request walks its chained block hashes once, keeping the nodes that still
match and intersecting them with each block's holders from the smaller side (set
operations: no Python step per node); it stops as soon as no node still matches, and
returns the nodes grouped by length (:class:`Matches`). A group that is a block's many
holders less a few is kept as such (:class:`NodeGroup`), not named node by node: a
prefix that most of a large cluster holds (a system prompt) costs the placement a few
set operations, not a dict of a thousand names (issue 27: "the prefix index's match
must not cost per node"). A block's memory is its own holders, independent of the
nodes in the cluster (a bitmask per block cost nodes/30 machine words each, 7.9 GB at
4,096 nodes and 10M blocks).

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

import bisect
import weakref
from collections.abc import Collection, ItemsView, Iterable, Iterator, Mapping, Sequence, Sized
from dataclasses import dataclass, field

from bus_schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

# Batches kept per node while a dump is outstanding; beyond this the node is simply
# re-dumped (the buffer only exists to bridge the dump's round trip).
MAX_BUFFERED_BATCHES = 10_000

# Holders kept as a tuple up to this many (a membership test walks it), a _Many beyond:
# a tuple of 2-3 ids is a quarter of a set's memory, and most blocks have 1-3 holders.
SMALL = 8

_NONE: frozenset[int] = frozenset()


class _Many:
    """A block's holders beyond :data:`SMALL`: their ids, and their names in order (so
    that the least holder outside a few busy ones is found in a short walk). Replaced,
    never changed, when a holder comes or goes: a :class:`NodeGroup` made from it stays
    what the match saw."""

    __slots__ = ("ids", "names", "__weakref__")

    def __init__(self, ids: frozenset[int], names: list[str]) -> None:
        self.ids = ids
        self.names = names


Holders = int | tuple[int, ...] | _Many


class NodeGroup:
    """The nodes matching one prefix length, when they are many: a block's holders
    (:class:`_Many`) less the few of them that match further (``minus``, ids). Sized,
    iterable (names, in order) and tested for membership like the list of names it
    stands for, but never built as one by the placement: it reads the group's size in
    instances (:meth:`weigh`) and its least node outside a few (:meth:`least`) in set
    operations and a short walk. Its holders are fixed when it is made; its ids are
    named through the index, so it is read before the index forgets or adds a node (a
    placement reads it in the step that matched)."""

    __slots__ = ("_many", "_minus", "_index")

    def __init__(self, many: _Many, minus: frozenset[int], index: "PrefixIndex") -> None:
        self._many = many
        self._minus = minus
        self._index = index

    def __len__(self) -> int:
        return len(self._many.ids) - len(self._minus)

    def has_id(self, nid: int) -> bool:
        return nid in self._many.ids and nid not in self._minus

    def __contains__(self, node: object) -> bool:
        nid = self._index._ids.get(node)  # type: ignore[call-overload]
        return nid is not None and self.has_id(nid)

    def __iter__(self) -> Iterator[str]:
        if not self._minus:
            return iter(self._many.names)
        out = set(map(self._index._by_id.__getitem__, self._minus))
        return (n for n in self._many.names if n not in out)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, NodeGroup | list | tuple | set | frozenset):
            return sorted(self) == sorted(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"NodeGroup({list(self)!r})"

    def less(self, ids: frozenset[int]) -> "NodeGroup":
        """The group less the nodes of ``ids``."""
        gone = ids.intersection(self._many.ids)
        if not gone:
            return self
        return NodeGroup(self._many, self._minus.union(gone), self._index)

    def least(self, skip: Collection[str] = ()) -> str | None:
        """The least node name of the group not in ``skip`` (None when every one is):
        a walk over the names in order that stops at the first, so it costs the skipped
        ones, not the group."""
        ids, minus = self._index._ids, self._minus
        for name in self._many.names:
            if name in skip or (minus and ids.get(name) in minus):
                continue
            return name
        return None

    def weigh(self, per_node: Mapping[str, Sized], weights: "NodeWeights") -> int:
        """``sum(len(per_node[n]) for n in self if n in per_node)`` (the placement's
        instances on the group's nodes) in set operations: ``weights`` keeps
        ``per_node`` in the index's ids, built again only when either changes."""
        ones, extra = weights.of(per_node, self._index)
        ids = self._many.ids
        total = len(ids.intersection(ones))
        if self._minus:
            total -= len(self._minus.intersection(ones))
        for nid, more in extra.items():
            if self.has_id(nid):
                total += more
        return total


class NodeWeights:
    """A map node -> items (the placement's instances by node) as the index's ids: the
    nodes with one item or more, and the items beyond one by node. The owner calls
    :meth:`changed` whenever the map changes; it is rebuilt on the next use after that,
    or after the index gave or took back an id."""

    def __init__(self) -> None:
        self._stamp: tuple[int, int] | None = None
        # The index the ids are of, held (not its id(): a new index can get a freed
        # one's id, and the same ids_version, with other ids for the nodes).
        self._index: PrefixIndex | None = None
        self._changes = 0
        self._ones: frozenset[int] = _NONE
        self._extra: dict[int, int] = {}

    def changed(self) -> None:
        self._changes += 1

    def of(
        self, per_node: Mapping[str, Sized], index: "PrefixIndex"
    ) -> tuple[frozenset[int], dict[int, int]]:
        stamp = (self._changes, index.ids_version)
        if stamp != self._stamp or index is not self._index:
            ones, extra = set(), {}
            for node, items in per_node.items():
                nid = index._ids.get(node)
                if nid is None or not items:
                    continue
                ones.add(nid)
                if len(items) > 1:
                    extra[nid] = len(items) - 1
            self._ones, self._extra, self._stamp = frozenset(ones), extra, stamp
            self._index = index
        return self._ones, self._extra


class Matches(Mapping[str, int]):
    """node -> prefix length in blocks (what :meth:`PrefixIndex.match` returns), with
    ``by_length``: length -> the nodes matching that many blocks (a list of names, or a
    :class:`NodeGroup` where they are many). The placement reads the groups (a few
    lengths) instead of walking every holder of a prefix that many nodes hold; a node's
    own length (``get``) is a dict lookup, or one set test per large group."""

    __slots__ = ("by_length", "_named", "_groups", "_ids")

    def __init__(self, ids: Mapping[str, int] | None = None) -> None:
        self.by_length: dict[int, list[str] | NodeGroup] = {}
        self._named: dict[str, int] = {}  # the nodes of the groups given as names
        self._groups: list[tuple[int, NodeGroup]] = []
        self._ids = ids  # the index's name -> id (for the NodeGroups)

    @classmethod
    def of(cls, lengths: Mapping[str, int]) -> "Matches":
        """The matches ``lengths`` gives (nodes with a length of at least 1)."""
        out = cls()
        for node, n in lengths.items():
            if n > 0:
                out._named[node] = n
                out.by_length.setdefault(n, []).append(node)  # type: ignore[union-attr]
        return out

    def _add(self, nodes: list[str], length: int) -> None:
        self._named.update(dict.fromkeys(nodes, length))
        self.by_length[length] = nodes

    def _add_group(self, group: NodeGroup, length: int) -> None:
        self._groups.append((length, group))
        self.by_length[length] = group

    def without(self, nodes: Collection[str]) -> "Matches":
        """These matches less ``nodes`` (stores that are down): itself when none of them
        matched, so that the usual case (every store alive) costs nothing per node."""
        if not nodes or not any(self.get(n) is not None for n in nodes):
            return self
        out = Matches(self._ids)
        ids = self._ids if self._ids is not None else {}
        gone = frozenset(ids[n] for n in nodes if n in ids)
        for length, group in self.by_length.items():
            if isinstance(group, NodeGroup):
                kept = group.less(gone)
                if len(kept):
                    out._add_group(kept, length)
            else:
                rest = [n for n in group if n not in nodes]
                if rest:
                    out._add(rest, length)
        return out

    def get(self, node: str, default: int | None = None) -> int | None:  # type: ignore[override]
        n = self._named.get(node)
        if n is not None or not self._groups:
            return default if n is None else n
        nid = self._ids.get(node) if self._ids is not None else None
        if nid is not None:
            for length, group in self._groups:
                if group.has_id(nid):
                    return length
        return default

    def __getitem__(self, node: str) -> int:
        n = self.get(node)
        if n is None:
            raise KeyError(node)
        return n

    def __contains__(self, node: object) -> bool:
        return self.get(node) is not None  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[str]:
        yield from self._named
        for _, group in self._groups:
            yield from group

    def __len__(self) -> int:
        return len(self._named) + sum(len(g) for _, g in self._groups)

    def items(self) -> ItemsView[str, int]:
        out = dict(self._named)
        for length, group in self._groups:
            out.update(dict.fromkeys(group, length))
        return out.items()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return dict(self.items()) == dict(other.items())
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Matches({dict(self.items())!r})"


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
        self._ids: dict[str, int] = {}
        self._free_ids: list[int] = []
        self._next_id = 0
        self.ids_version = 0  # moves when a node gets an id or gives one back
        # One _Many per set of holders: a prompt's blocks, stored and evicted together,
        # share it, so a match steps along them by identity, not by comparing sets.
        self._manys: weakref.WeakValueDictionary[frozenset[int], _Many] = (
            weakref.WeakValueDictionary()
        )

    # ---------------------------------------------------------------- queries

    def nodes(self) -> list[str]:
        return sorted(self._nodes)

    def node_names(self) -> Collection[str]:
        """Every node the index tracks, as a live view (no copy)."""
        return self._ids.keys()

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
        ids = (v,) if isinstance(v, int) else v.ids if isinstance(v, _Many) else v
        return frozenset(self._by_id[i] for i in ids)

    def match(self, block_hashes: Sequence[int]) -> "Matches":
        """Prefix length in blocks per node, for nodes holding at least the first block
        (a mapping, with the same nodes grouped by length in ``by_length``). The per-node
        work is done by set operations; a group that is a block's many holders less a
        few is a :class:`NodeGroup`, not a list of names: a prefix every node of a large
        cluster holds costs little per node."""
        out = Matches(self._ids)
        if not block_hashes:
            return out
        holders = self._holders
        first = holders.get(block_hashes[0])
        if first is None:
            return out
        # Sets are never mutated below (each change makes a new one). ``many``: the
        # block holders that ``alive`` is exactly, when it is (its names are in order).
        many: _Many | None = None
        alive: frozenset[int]
        if isinstance(first, int):
            alive = frozenset((first,))
        elif isinstance(first, tuple):
            alive = frozenset(first)
        else:
            alive, many = first.ids, first
        name = self._by_id.__getitem__
        total = len(block_hashes)
        prev: Holders = first
        for i in range(1, total):
            v = holders.get(block_hashes[i])
            if v is prev:
                continue  # the holders of the block before: those still matching hold it
            still_many: _Many | None = None
            if v is None:
                still: frozenset[int] = _NONE
            elif isinstance(v, int):
                if v in alive:
                    if len(alive) == 1:
                        prev = v
                        continue
                    still = frozenset((v,))
                else:
                    still = _NONE
            elif isinstance(v, tuple):
                still = alive.intersection(v)
            else:
                still = alive.intersection(v.ids)
                if len(still) == len(v.ids):
                    still, still_many = v.ids, v  # v's holders all still match
            if len(still) != len(alive):
                if many is not None and 2 * len(still) <= len(alive):
                    out._add_group(NodeGroup(many, still, self), i)
                else:
                    out._add(list(map(name, alive.difference(still) if still else alive)), i)
                if not still:
                    return out
                alive, many = still, still_many
            elif still_many is not None:
                many = still_many  # the same nodes, named by this block's holders
            prev = v  # type: ignore[assignment]  # not None here: None ends the match
        if many is not None:
            out._add_group(NodeGroup(many, _NONE, self), total)
        else:
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
        del self._ids[node]
        self._free_ids.append(n.id)
        self.ids_version += 1

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
        self._ids[node] = nid
        self.ids_version += 1
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
            if len(v) < SMALL:
                holders[h] = v + (nid,)
            else:
                holders[h] = self._many(frozenset((*v, nid)), None)
        else:
            holders[h] = self._many(v.ids.union((nid,)), (v.names, self._by_id[nid], True))

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
            ids = v.ids.difference((nid,))
            if len(ids) <= SMALL // 2:  # back to a tuple, with room before the next _Many
                holders[h] = tuple(ids)
            else:
                holders[h] = self._many(ids, (v.names, self._by_id[nid], False))

    def _many(self, ids: frozenset[int], edit: tuple[list[str], str, bool] | None) -> _Many:
        """The _Many of ``ids`` (the one already made, if any). ``edit``: (names of a
        set that differs from ``ids`` by one node, that node, added or not), so that
        the names in order cost a copy and a bisection, not a sort."""
        many = self._manys.get(ids)
        if many is not None:
            return many
        if edit is None:
            names = sorted(map(self._by_id.__getitem__, ids))
        else:
            base, node, added = edit
            names = base.copy()
            at = bisect.bisect_left(names, node)
            if added:
                names.insert(at, node)
            else:
                del names[at]
        many = self._manys[ids] = _Many(ids, names)
        return many

    def _clear(self, n: _Node) -> None:
        for h in n.blocks:
            self._remove(h, n.id)
        n.blocks = set()
