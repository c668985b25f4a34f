"""Objects on one store (Mooncake Store's put/get): a key's value kept as pool blocks.

Lifecycle of a key on a node::

    OBJ_PUT key, bytes  -> blocks allocated (PREFILL tx on fresh hashes of key+version),
                           bytes copied in, committed: cached like KV blocks (tiers,
                           eviction, write-back); an older version's blocks are removed
    OBJ_GET key         -> SOURCE tx over its blocks (promoted from SSD if need be),
                           bytes sent, tx committed; a block evicted meanwhile makes the
                           key ``missing`` (and forgets it)
    obj.remove / obj.stat / obj.replicate over NATS (see server.py)
    obj.replicate       -> ``reserve``: a PREFILL tx on fresh hashes; the bytes pulled
                           into its slots from the source store's SOURCE tx through
                           the transfer engine; ``adopt`` commits it (``cancel`` on failure)

The table (key -> size, block hashes) lives in memory; with an SSD tier, object
blocks are written back like KV blocks and the SSD index carries the keys whose
blocks are all on SSD (``persistable``), so a restarted store gets them back
(``restore``). Block hashes come from (key, version), versions counting from the
store's epoch (start time in ns), so a new put never collides with a restored one.
"""

import hashlib
from dataclasses import dataclass
from typing import Any

from bus_schemas.control import Refused, TxAllocate, TxRole
from bus_schemas.kv_events import BlockRemoved, BlockStored, KVEvent
from bus_schemas.requests import Retention
from services.store.node.store_core import StoreCore
from services.store.pool.block_pool import Allocation
from services.transfer import wire


def object_hashes(key: str, version: int, n: int) -> list[int]:
    base = hashlib.blake2b(f"obj\0{key}\0{version}".encode(), digest_size=8).digest()
    return [
        int.from_bytes(hashlib.blake2b(base + i.to_bytes(4, "big"), digest_size=8).digest(), "big")
        >> 1
        for i in range(n)
    ]


@dataclass
class _Meta:
    size: int
    hashes: list[int]


class ObjectService:
    """One store's objects: each key's value kept as pool blocks, by version."""

    def __init__(self, core: StoreCore) -> None:
        self.core = core
        self.table: dict[str, _Meta] = {}
        self.block_hashes: set[int] = set()  # of every object: kept out of KV events
        self._version = core.epoch
        self._doomed: set[int] = set()  # blocks of dropped keys, busy when dropped
        self.counters = {
            "obj_puts": 0,
            "obj_copies_in": 0,
            "obj_gets": 0,
            "obj_misses": 0,
            "obj_bytes_in": 0,
            "obj_bytes_out": 0,
        }

    def _nblocks(self, size: int) -> int:
        return max(1, -(-size // self.core.block_bytes))

    def put(self, h: wire.ObjPut, payload: list[memoryview]) -> tuple[Any, list[Any]]:
        pool = self.core.pool
        got = sum(len(p) for p in payload)
        if got != h.size or h.size < 0:
            raise wire.WireError(
                f"payload has {got} bytes, header says {h.size}", "bad_request", h.id
            )
        self.reap()
        self._version += 1
        n = self._nblocks(h.size)
        hashes = object_hashes(h.key, self._version, n)
        retention = Retention(h.retention) if h.retention in (0, 2) else Retention.DEFAULT
        self.block_hashes.update(hashes)  # before the put: its BlockStored is not KV
        slots = pool.put_blocks(hashes, retention)
        if isinstance(slots, Refused):
            self.block_hashes.difference_update(hashes)
            raise wire.WireError(
                f"object {h.key!r} ({h.size} bytes): {slots.message}", slots.reason, h.id
            )
        wire.scatter(payload, _trim(self.core.spans(slots), h.size))
        old = self.table.get(h.key)
        self.table[h.key] = _Meta(h.size, hashes)
        if old is not None:
            self._drop(old)
        self.counters["obj_puts"] += 1
        self.counters["obj_bytes_in"] += h.size
        return wire.Ok(id=h.id, nbytes=h.size), []

    def reserve(self, key: str, size: int) -> tuple[Allocation | Refused, list[int]]:
        """Blocks for a copy of ``key`` whose ``size`` bytes arrive later (pulled from
        another store): a PREFILL tx on fresh hashes, not visible to readers until
        ``adopt``; ``cancel`` gives them back."""
        self.reap()
        self._version += 1
        n = self._nblocks(size)
        hashes = object_hashes(key, self._version, n)
        self.block_hashes.update(hashes)  # before the commit: its BlockStored is not KV
        got = self.core.pool.allocate(
            TxAllocate(
                request_id=f"obj:{key}",
                role=TxRole.PREFILL,
                block_hashes=hashes,
                num_tokens=n * self.core.block_size,
                lease_s=30.0,
            )
        )
        if isinstance(got, Refused):
            self.block_hashes.difference_update(hashes)
        return got, hashes

    def adopt(self, key: str, size: int, hashes: list[int], tx_id: str) -> int | Refused:
        """Commit a ``reserve``d copy whose bytes have landed; returns the size kept.
        A put of the key that landed meanwhile is newer: the copy is dropped for it."""
        if key in self.table:
            self.cancel(hashes, tx_id)
            return self.table[key].size
        done = self.core.pool.commit(tx_id)
        if isinstance(done, Refused):
            self.block_hashes.difference_update(hashes)
            return done
        self.table[key] = _Meta(size, hashes)
        self.counters["obj_copies_in"] += 1
        self.counters["obj_bytes_in"] += size
        return size

    def cancel(self, hashes: list[int], tx_id: str) -> None:
        self.core.pool.abort(tx_id)
        self.block_hashes.difference_update(hashes)

    def hashes(self, key: str) -> list[int]:
        meta = self.table.get(key)
        return list(meta.hashes) if meta is not None else []

    def get(self, h: wire.ObjGet) -> tuple[Any, list[Any]]:
        data = self.read(h.key)
        if data is None:  # a miss is an answer, not an error worth a log line
            self.counters["obj_misses"] += 1
            return wire.Err(
                id=h.id, code="missing", message=f"object {h.key!r} is not on this node"
            ), []
        self.counters["obj_gets"] += 1
        self.counters["obj_bytes_out"] += sum(len(d) for d in data)
        return wire.Ok(id=h.id, nbytes=sum(len(d) for d in data)), list(data)

    def read(self, key: str) -> list[memoryview] | None:
        """The value's bytes as views, copied out before the SOURCE tx closes (None: missing)."""
        pool = self.core.pool
        meta = self.table.get(key)
        if meta is None:
            return None
        slots = pool.dram_slots(meta.hashes)
        if slots is not None:  # all in DRAM: copy out now, in this same step
            return [memoryview(bytes(v)) for v in _trim(self.core.spans(slots), meta.size)]
        req = TxAllocate(
            request_id=f"obj:{key}",
            role=TxRole.SOURCE,
            block_hashes=meta.hashes,
            num_tokens=0,
            lease_s=30.0,
        )
        result = pool.allocate(req)  # promotes what is not in DRAM (moves run meanwhile)
        if isinstance(result, Refused):
            self.table.pop(key, None)
            return None
        try:
            out = [memoryview(bytes(v)) for v in _trim(self.core.spans(result.slots), meta.size)]
        finally:
            pool.commit(result.tx_id)
        return out

    def stat(self, key: str) -> int | None:
        meta = self.table.get(key)
        if meta is None or not all(self.core.pool.is_cached(h) for h in meta.hashes):
            return None
        return meta.size

    def remove(self, key: str) -> bool:
        meta = self.table.pop(key, None)
        if meta is None:
            return False
        self._drop(meta)
        return True

    def _drop(self, meta: _Meta) -> None:
        """Remove a key's blocks; one being written back (busy) stays an object block and
        goes at the next ``reap``."""
        _, busy = self.core.pool.remove(meta.hashes)
        self.block_hashes.difference_update(h for h in meta.hashes if h not in busy)
        self._doomed.update(busy)

    def reap(self) -> None:
        """Remove blocks of dropped keys that were busy then (after write-backs end)."""
        if not self._doomed:
            return
        removed, busy = self.core.pool.remove(sorted(self._doomed))
        self._doomed = set(busy)
        self.block_hashes.difference_update(removed)

    def persistable(self, on_ssd: set[int]) -> list[tuple[str, int, list[int]]]:
        """(key, size, hashes) of the objects whose blocks are all in ``on_ssd``."""
        return [
            (k, m.size, m.hashes)
            for k, m in self.table.items()
            if all(h in on_ssd for h in m.hashes)
        ]

    def expect(self, object_blocks: set[int]) -> None:
        """Before the pool reloads a previous run's SSD index: these blocks are objects',
        so the reload's BlockStored leaves them out of KV events."""
        self.block_hashes.update(object_blocks)

    def restore(
        self, objects: list[tuple[str, int, list[int]]], object_blocks: set[int]
    ) -> list[int]:
        """After the reload (``expect`` before it): take back the objects a previous run
        saved whose blocks are all on the node again; returns the other object blocks on
        the node (of objects that did not come back whole), for the caller to drop."""
        pool = self.core.pool
        self.block_hashes.difference_update(h for h in object_blocks if not pool.on_node(h))
        kept: set[int] = set()
        for key, size, hashes in objects:
            if (
                hashes
                and len(hashes) == self._nblocks(size)
                and all(pool.on_node(h) for h in hashes)
            ):
                self.table[key] = _Meta(size, list(hashes))
                self.block_hashes.update(hashes)
                kept.update(hashes)
        return sorted(h for h in object_blocks if h not in kept and pool.on_node(h))

    def kv_only(self, events: list[KVEvent]) -> list[KVEvent]:
        """``events`` without object blocks: KV-event consumers index prompts, not objects."""
        if not self.block_hashes:
            return events
        out: list[KVEvent] = []
        for ev in events:
            if isinstance(ev, BlockStored | BlockRemoved):
                keep = [h for h in ev.block_hashes if h not in self.block_hashes]
                if isinstance(ev, BlockRemoved):
                    self.block_hashes.difference_update(ev.block_hashes)
                if keep:
                    out.append(type(ev)(block_hashes=keep))
            else:
                out.append(ev)
        return out


def _trim(spans: list[memoryview], size: int) -> list[memoryview]:
    out = []
    for sp in spans:
        if size <= 0:
            break
        out.append(sp[: min(len(sp), size)])
        size -= len(out[-1])
    return out
