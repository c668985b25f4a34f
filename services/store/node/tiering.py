"""The store service's side of tiers: byte stores, moves, write-back, the SSD index.

Lifecycle (owned by :class:`~services.store.node.server.StoreService`)::

    open        make the SSD store (--ssd-dir) and the GPU store (when CUDA is there;
                skipped with a log line otherwise), reload the SSD index a previous run
                left: those blocks are on the node again, announced as BlockStored in
                the new epoch's first batch (objects' blocks are not KV: their keys are
                back in the object table instead; blocks of an object that did not
                come back whole are dropped)
    run_moves   after every pool operation, in the same step (the store's collect hook):
                promotions / demotions / offloads, in order (an SSD read or write of a
                block is a page-cache copy); wakes the write-back task when the pool has
                write-backs queued or the SSD index changed
    write-back  task: pool.writebacks() -> copy DRAM -> SSD on a worker thread (the DRAM
                copy is locked meanwhile) -> writeback_done -> index saved if changed
    close       save the index (with the objects whose blocks are all on SSD), close files
"""

import asyncio
import time
from collections import deque

import structlog

from bus_schemas.kv_events import EventBatch
from services.store.node.object_service import ObjectService
from services.store.node.store_core import StoreCore
from services.store.node.tier_stores import (
    ArenaStore,
    SsdStore,
    TierStore,
    VramStore,
    execute,
    vram_available,
)
from services.store.pool.tier_policy import Tier

log = structlog.get_logger()
WRITEBACK_BATCH = 32


def vram_ok(capacity: int) -> bool:
    if capacity <= 0:
        return False
    ok, why = vram_available()
    if not ok:
        log.info("vram_tier_skipped", reason=why)
    return ok


class ReplayBuffer:
    """The last ``capacity`` event batches, for consumers that missed some."""

    def __init__(self, capacity: int) -> None:
        self.batches: deque[EventBatch] = deque(maxlen=max(1, capacity))

    def add(self, batch: EventBatch) -> None:
        self.batches.append(batch)

    def after(self, seq: int, limit: int) -> tuple[list[EventBatch], bool]:
        """Batches with seq > ``seq`` (at most ``limit``), and whether none was dropped."""
        out = [b for b in self.batches if b.seq > seq][: max(1, limit)]
        oldest = self.batches[0].seq if self.batches else None
        complete = oldest is None or oldest <= seq + 1
        return out, complete


class Tiers:
    """The store's lower tiers in bytes: SSD and GPU stores, block moves, write-back."""

    def __init__(
        self,
        core: StoreCore,
        objects: ObjectService,
        *,
        ssd_dir: str | None = None,
        vram_capacity_blocks: int = 0,
    ) -> None:
        self.core = core
        self.objects = objects
        self.ssd_dir = ssd_dir
        self.vram_capacity_blocks = vram_capacity_blocks
        self.stores: dict[Tier, TierStore] = {}
        self.ssd: SsdStore | None = None
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()  # the write-back task found nothing it could start
        self._saved_at = 0.0

    def open(self) -> None:
        core, pool = self.core, self.core.pool
        assert core.arena is not None
        self.stores[Tier.DRAM] = ArenaStore(core.arena)
        if pool.ssd is not None and self.ssd_dir:
            self.ssd = SsdStore(self.ssd_dir, pool.ssd.capacity, core.block_bytes)
            self.stores[Tier.SSD] = self.ssd
            state = self.ssd.load_state()
            now_wall, now = time.time(), core.clock.now()
            restored = [
                (h, slot, None if until is None else now + (until - now_wall))
                for h, slot, until in state.entries
            ]
            self.objects.expect(state.object_blocks)  # object blocks stay out of KV events
            pool.restore(restored)
            orphans = self.objects.restore(state.objects, state.object_blocks)
            if orphans:
                pool.remove(orphans)
            log.info(
                "ssd_tier_open",
                dir=self.ssd_dir,
                capacity_blocks=pool.ssd.capacity,
                restored_blocks=len(pool.ssd),
                restored_objects=len(self.objects.table),
                dropped_object_blocks=len(orphans),
            )
        if any(t.tier == Tier.VRAM for t in pool.lower):
            self.stores[Tier.VRAM] = VramStore(self.vram_capacity_blocks, core.block_bytes)

    def run_moves(self) -> None:
        pool = self.core.pool
        moves = pool.take_moves()
        if moves:
            execute(moves, self.stores, self.core.block_bytes)
        if self.ssd is not None and (pool.ssd_dirty or pool.writeback_pending()):
            self.wake()  # the write-back task copies and saves the index (off this step)

    def wake(self) -> None:
        self._wake.set()

    async def run_writeback(self) -> None:
        pool = self.core.pool
        if self.ssd is None:
            return
        while True:
            await self._wake.wait()
            moves = pool.writebacks(WRITEBACK_BATCH)
            if not moves:
                self._wake.clear()
                if pool.ssd_dirty:
                    self.save()
                self._idle.set()
                continue
            results = await asyncio.to_thread(self._write, moves)
            for m, ok in zip(moves, results, strict=True):
                pool.writeback_done(m.block_hash, ok)
            self.objects.reap()
            if time.monotonic() - self._saved_at > 0.5:
                self.save()

    async def flush(self, timeout_s: float) -> bool:
        """Before a graceful stop: let the write-back task empty its queue (an SSD tier
        should survive a restart with what DRAM held), for at most ``timeout_s``.
        True when nothing is left to write."""
        pool = self.core.pool
        if self.ssd is None or not pool.writeback_pending():
            return True
        self._idle.clear()
        self.wake()
        try:  # idle again: everything written, or nothing more fits on the SSD tier
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            pass
        return pool.writeback_pending() == 0

    def _write(self, moves) -> list[bool]:
        out = []
        for m in moves:
            try:
                execute([m], self.stores, self.core.block_bytes)
                out.append(True)
            except OSError as e:
                log.warning("writeback_failed", block=m.block_hash, error=str(e))
                out.append(False)
        return out

    def save(self) -> None:
        if self.ssd is None:
            return
        now_wall, now = time.time(), self.core.clock.now()
        entries = [
            (h, slot, None if until is None else now_wall + (until - now))
            for h, slot, until in self.core.pool.ssd_entries()
        ]
        on_ssd = {h for h, _, _ in entries}
        objects = self.objects
        try:
            self.ssd.save_index(entries, objects.persistable(on_ssd), on_ssd & objects.block_hashes)
            self.core.pool.ssd_dirty = False
            self._saved_at = time.monotonic()
        except OSError as e:
            log.warning("ssd_index_save_failed", error=str(e))

    def close(self) -> None:
        if self.ssd is not None:
            self.save()
            self.ssd.close()
