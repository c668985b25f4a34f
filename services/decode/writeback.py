"""Decode write-back (issue 24): what a request generates is KV like any other, so its
whole blocks go into this node's store, under the chained hashes of prompt + answer,
and the next turn of the conversation reuses the whole of it.

Lifecycle of one request's write-back (:class:`AnswerWriteBack`):

    Filling    the engine hands over each block of KV as it fills (``DecodeJob.on_block``:
               block j, from the one holding the prompt's end onwards), copied from its
               own paged cache; the worker adds the tokens as they stream
    Ready      block j has its bytes and its tokens, so its hash is known
    Writing    one transaction at a time, after the prompt's decode_tx is committed:
               TxAllocate(DECODE, writeback) over the chain up to the last ready block
               locks the prefix already here and gives slots for the rest; the bytes
               go into those slots (shared memory), TxCommit caches them, and the store
               announces BlockStored like any other block, so the conductor's index and
               the next turn's placement see them
    Done       :meth:`finish` waits for the last transaction before the request's
               Finished goes out: a client's next turn finds the answer indexed

A block is written only behind a contiguous chain: should the store no longer hold the
blocks before it (evicted meanwhile, a restart), it could never be matched, so the
request's write-back stops there (``writeback_broken``). Ephemeral requests write
nothing (their blocks are never cached). Failures cost the cache, never the request.
"""

import asyncio
from collections.abc import Sequence
from typing import Protocol

import structlog

from bus_schemas.control import TxAllocate, TxHandle, TxRole
from bus_schemas.requests import GenerateRequest, Retention
from services.common.hashing import block_hashes, hash_block
from services.common.store_tx import StoreTx

log = structlog.get_logger()

COUNTERS = (
    "writeback_blocks",  # answer blocks the store cached from this worker
    "writeback_duplicate_blocks",  # already on the node (another request wrote them)
    "writeback_txs",
    "writeback_failed",  # a transaction refused, unanswered or not committed
    "writeback_broken",  # the chain before a block was gone: the rest was not written
)


class WriteBackStore(Protocol):
    """What this needs of services.store.client.StoreClient."""

    def slot(self, i: int) -> memoryview: ...

    async def attached(self, tx: TxHandle) -> None: ...


def prompt_chain(req: GenerateRequest, block_size: int) -> list[int]:
    """The prompt's full-block hashes as the decode_tx was committed under (the request's
    own when it carries them for this block size)."""
    n_full = len(req.prompt_token_ids) // block_size
    if req.block_hashes is not None and req.block_size == block_size:
        if len(req.block_hashes) == n_full:
            return list(req.block_hashes)
    return block_hashes(req.prompt_token_ids, block_size)


class AnswerWriteBack:
    def __init__(
        self,
        req: GenerateRequest,
        *,
        node: str,
        store: WriteBackStore,
        store_tx: StoreTx,
        block_size: int,
        block_bytes: int,
        counters: dict[str, int],
        lease_s: float = 10.0,
    ) -> None:
        self.req = req
        self.node = node
        self.store = store
        self.store_tx = store_tx
        self.bs = block_size
        self.block_bytes = block_bytes
        self.counters = counters
        self.lease_s = lease_s
        # The prompt's decode_tx is committed (or given up): its blocks head the chain.
        self._committed = asyncio.Event()
        self.tokens: list[int] = list(req.prompt_token_ids)
        self.hashes = prompt_chain(req, block_size)
        self._bytes: dict[int, memoryview] = {}  # ready or filling blocks, by index
        self._next = len(self.hashes)  # first block not yet written
        self._task: asyncio.Task[None] | None = None
        self.enabled = req.retention != Retention.EPHEMERAL
        self.written = 0  # blocks cached by this request's write-back

    # -- fed by the worker --
    def on_block(self, j: int, data: memoryview) -> None:
        if not self.enabled or j < self._next:
            return
        if len(data) < self.block_bytes:
            log.warning("writeback_short_block", block=j, size=len(data))
            self.enabled = False
            return
        self._bytes[j] = data
        self._kick()

    def add_tokens(self, toks: Sequence[int]) -> None:
        self.tokens.extend(toks)
        if self._bytes:
            self._kick()

    def prompt_committed(self) -> None:
        self._committed.set()
        self._kick()

    async def finish(self) -> None:
        """Wait until every block handed over so far is written (or given up)."""
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)

    def cancel(self) -> None:
        self.enabled = False
        if self._task is not None:
            self._task.cancel()

    # -- writing --
    def _ready(self) -> int:
        """Blocks from ``_next`` on that have bytes and tokens, contiguous."""
        j = self._next
        while j in self._bytes and (j + 1) * self.bs <= len(self.tokens):
            j += 1
        return j - self._next

    def _kick(self) -> None:
        if self.enabled and (self._task is None or self._task.done()) and self._ready():
            self._task = asyncio.get_running_loop().create_task(
                self._drain(), name=f"writeback-{self.req.request_id}"
            )

    async def _drain(self) -> None:
        await self._committed.wait()
        while self.enabled and (k := self._ready()):
            await self._write(self._next, self._next + k)

    async def _write(self, first: int, end: int) -> None:
        for j in range(len(self.hashes), end):
            parent = self.hashes[j - 1] if j else None
            self.hashes.append(hash_block(parent, self.tokens[j * self.bs : (j + 1) * self.bs]))
        rid = self.req.request_id
        self.counters["writeback_txs"] += 1
        alloc = await self.store_tx.allocate(
            {
                "writeback": (
                    self.node,
                    TxAllocate(
                        request_id=rid,
                        role=TxRole.DECODE,
                        block_hashes=self.hashes[:end],
                        num_tokens=end * self.bs,
                        retention=self.req.retention,
                        context_ttl_s=self.req.context_ttl_s,
                        lease_s=self.lease_s,
                        writeback=True,
                    ),
                )
            }
        )
        got = alloc.handles.get("writeback")
        if got is None:
            why = alloc.refused.get("writeback") or alloc.failed.get("writeback")
            log.info("writeback_refused", reason=why, blocks=end - first)
            self.counters["writeback_failed"] += 1
            self._give_up(end)
            return
        _, h = got
        if h.hit_blocks < first:
            # The chain before ``first`` left the node: nothing after it can be matched.
            await self.store_tx.abort(self.node, h.tx_id, rid, "writeback chain broken")
            log.info("writeback_broken", on_node=h.hit_blocks, first=first)
            self.counters["writeback_broken"] += 1
            self.enabled = False
            return
        try:
            await self.store.attached(h)
            for j in range(h.hit_blocks, end):
                self.store.slot(h.slots[j])[: self.block_bytes] = self._bytes[j][: self.block_bytes]
        except Exception as e:  # noqa: BLE001 - the cache loses, the request goes on
            log.warning("writeback_copy_failed", error=f"{type(e).__name__}: {e}")
            await self.store_tx.abort(self.node, h.tx_id, rid, "writeback copy failed")
            self.counters["writeback_failed"] += 1
            self._give_up(end)
            return
        ok = await self.store_tx.commit(self.node, h.tx_id, rid)
        if not ok:
            self.counters["writeback_failed"] += 1
            self._give_up(end)
            return
        new = end - min(max(h.hit_blocks, first), end)
        self.counters["writeback_duplicate_blocks"] += (end - first) - new
        self.written += new
        self.counters["writeback_blocks"] += new
        for j in range(first, end):
            self._bytes.pop(j, None)
        self._next = end

    def _give_up(self, end: int) -> None:
        """A failed transaction: the chain has a hole at these blocks, so stop here."""
        self.enabled = False
        for j in list(self._bytes):
            if j < end:
                del self._bytes[j]
