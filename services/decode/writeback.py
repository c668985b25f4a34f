"""Decode write-back (issue 24): what a request generates is KV like any other, so its
whole blocks go into this node's store, under the chained hashes of prompt + answer,
and the next turn of the conversation reuses the whole of it.

Lifecycle of one request's write-back (:class:`AnswerWriteBack`):

    Filling    the engine hands over each block of KV as it fills (``DecodeJob.on_block``:
               block j, from the one holding the prompt's end onwards), copied from its
               own paged cache; the worker adds the tokens as they stream
    Ready      block j has its bytes and its tokens, so its hash is known
    Writing    one transaction at a time, after the prompt's decode_tx is committed:
               TxAllocate(DECODE, answer) over the chain up to the last ready block
               locks the prefix already here and gives slots for the rest; the bytes
               go into those slots (shared memory), TxCommit caches them, and the store
               announces BlockStored like any other block, so the conductor's index and
               the next turn's placement see them
    Following  the same transaction opens on the prefill node that served the prompt
               (it holds the prompt's blocks), and the blocks it lacks are shipped
               there from this node's open transaction over the data plane, then
               committed: the conversation stays whole where its prompt is, so the
               next turn's placement (Algorithm 1, unchanged) finds all of it on one
               node. Without this the next turn would find the prompt there and the
               answer here, a few blocks longer: below the balancing threshold
               (best / own <= 2), so the answer would be recomputed
    Done       :meth:`finish` waits for the last transaction (and one more round to
               the prefill node if it missed some) before the request's Finished
               goes out: a client's next turn finds the answer indexed; should the
               prefill node still lack the prompt, it is asked again in the
               background (FOLLOW_RETRY_S)

Retention (the store's semantics-aware policy, services.store.pool.block_pool): a turn's
write-back commits at the end of the turn, after its decode_tx, and locks the prompt's
blocks on its way, so the conversation's last turn is the node's most recently used
chain: under pressure other, older conversations go first, and within the last turn
the chain's tail (the answer) before its head (locks and expired pins are released
tail first). A CONTEXT_CACHE turn pins its answer for ``context_ttl_s`` from the end
of the turn, and renews its prompt's pin to the same end; EPHEMERAL writes nothing.
Evicted answer blocks demote to lower tiers like any other; hits on them are counted
by tier (the store's ``answer_hits_{vram,dram,ssd}``). Tests: tests/unit/store/
test_writeback_retention.py.

A block is written only behind a contiguous chain: should the store no longer hold the
blocks before it (evicted meanwhile, a restart), it could never be matched, so the
request's write-back stops there (``writeback_broken``). Ephemeral requests write
nothing (their blocks are never cached). Failures cost the cache, never the request.
"""

import asyncio
import contextvars
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import structlog

from bus_schemas.control import TxAllocate, TxHandle, TxRole
from bus_schemas.requests import GenerateRequest, Retention
from services.common.hashing import block_hashes, hash_block
from services.common.store_tx import StoreTx

log = structlog.get_logger()

# A prefill node that did not hold the prompt yet when the answer was done (the
# conductor commits it after the first token) is asked again this long after, in the
# background: the client has its Finished, a next turn comes later.
FOLLOW_RETRY_S = (0.25, 1.0)
_BACKGROUND: set[asyncio.Task[None]] = set()  # catch-ups running (a task needs a reference)

COUNTERS = (
    "writeback_blocks",  # answer blocks the store cached from this worker
    "writeback_duplicate_blocks",  # already on the node (another request wrote them)
    "writeback_txs",
    "writeback_failed",  # a transaction refused, unanswered or not committed
    "writeback_broken",  # the chain before a block was gone: the rest was not written
    "writeback_followed_blocks",  # shipped on to the prefill node that holds the prompt
    "writeback_follow_failed",
)


class WriteBackStore(Protocol):
    """What this needs of services.store.client.store_client.StoreClient."""

    def slot(self, i: int) -> memoryview: ...

    async def attached(self, tx: TxHandle) -> None: ...

    async def ship_layer(
        self,
        src: TxHandle,
        dst: TxHandle,
        layer: int,
        blocks: list[int],
        layer_bytes: int,
        layer_offset: int,
    ) -> None: ...


def prompt_chain(req: GenerateRequest, block_size: int) -> list[int]:
    """The prompt's full-block hashes as the decode_tx was committed under (the request's
    own when it carries them for this block size). The count is guarded here although
    admission checked it: a decode task comes from a prefill login (any prefill may
    send to any decode instance), and the answer's chain is indexed from this list's
    length, so a list off the prompt gives way to the tokens' own chain."""
    n_full = len(req.prompt_token_ids) // block_size
    if req.block_hashes is not None and req.block_size == block_size:
        if len(req.block_hashes) == n_full:
            return list(req.block_hashes)
    return block_hashes(req.prompt_token_ids, block_size)


class AnswerWriteBack:
    """Writes one request's generated blocks back to its node's store as they fill."""

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
        follow_node: str | None = None,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        retry_s: Sequence[float] = FOLLOW_RETRY_S,
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
        # The prefill node that holds the prompt: the answer follows it there (module doc).
        self.follow_node = follow_node if follow_node not in (None, "", node) else None
        self.follow_pending = False
        self._prompt_blocks = len(self.hashes)
        self.catch_up: asyncio.Task[None] | None = None
        self._sleep = sleep
        self._retry_s = tuple(retry_s)
        # Made in the request's context (its trace, its request id for the logs); its
        # writes start from the engine's callbacks and timers, which are in none.
        self._ctx = contextvars.copy_context()

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

    def idle(self) -> bool:
        """Nothing in flight and nothing :meth:`finish` would write now."""
        writing = self._task is not None and not self._task.done()
        return not writing and not (
            self.enabled
            and (self._ready() or (self.follow_pending and self._next > self._prompt_blocks))
        )

    async def finish(self) -> None:
        """Wait until every block handed over so far is written (or given up); then, if
        the prefill node missed some of them, one last round takes them there."""
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)
        if self.enabled and self.follow_pending and self._next > self._prompt_blocks:
            await self._write(self._next, self._next)
            if self.enabled and self.follow_pending and self._retry_s:
                t = asyncio.get_running_loop().create_task(
                    self._catch_up(),
                    name=f"writeback-follow-{self.req.request_id}",
                    context=self._ctx.copy(),
                )
                _BACKGROUND.add(t)
                t.add_done_callback(_BACKGROUND.discard)
                self.catch_up = t

    async def _catch_up(self) -> None:
        for delay in self._retry_s:
            await self._sleep(delay)
            if not (self.enabled and self.follow_pending):
                return
            await self._write(self._next, self._next)

    def cancel(self) -> None:
        """The request failed: stop writing (what is committed stays)."""
        self.enabled = False
        for t in (self._task, self.catch_up):
            if t is not None:
                t.cancel()

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
                self._drain(), name=f"writeback-{self.req.request_id}", context=self._ctx.copy()
            )

    async def _drain(self) -> None:
        await self._committed.wait()
        while self.enabled and (k := self._ready()):
            await self._write(self._next, self._next + k)

    async def _write(self, first: int, end: int) -> None:
        """Blocks [first, end) into this node's store (and the chain up to ``end`` to the
        prefill node, :meth:`_follow`); ``first == end`` follows only."""
        for j in range(len(self.hashes), end):
            parent = self.hashes[j - 1] if j else None
            self.hashes.append(hash_block(parent, self.tokens[j * self.bs : (j + 1) * self.bs]))
        rid = self.req.request_id
        msg = TxAllocate(
            request_id=rid,
            role=TxRole.DECODE,
            block_hashes=self.hashes[:end],
            num_tokens=end * self.bs,
            retention=self.req.retention,
            context_ttl_s=self.req.context_ttl_s,
            lease_s=self.lease_s,
            answer=True,
        )
        jobs = {"writeback": (self.node, msg)}
        if self.follow_node is not None:
            jobs["follow"] = (self.follow_node, msg)
        self.counters["writeback_txs"] += 1
        alloc = await self.store_tx.allocate(jobs)
        far = alloc.handles.get("follow")
        got = alloc.handles.get("writeback")
        if got is None or got[1].hit_blocks < first:
            if far is not None:
                await self.store_tx.abort(far[0], far[1].tx_id, rid, "writeback not written")
            if got is None:
                why = alloc.refused.get("writeback") or alloc.failed.get("writeback")
                log.info("writeback_refused", reason=why, blocks=end - first)
                self.counters["writeback_failed"] += 1
                self._give_up(end)
            else:
                # The chain before ``first`` left the node: nothing after it can be matched.
                await self.store_tx.abort(self.node, got[1].tx_id, rid, "writeback chain broken")
                log.info("writeback_broken", on_node=got[1].hit_blocks, first=first)
                self.counters["writeback_broken"] += 1
                self.enabled = False
            return
        h = got[1]
        try:
            await self.store.attached(h)
            for j in range(h.hit_blocks, end):
                self.store.slot(h.slots[j])[: self.block_bytes] = self._bytes[j][: self.block_bytes]
        except Exception as e:  # noqa: BLE001 - the cache loses, the request goes on
            log.warning("writeback_copy_failed", error=f"{type(e).__name__}: {e}")
            await self.store_tx.abort(self.node, h.tx_id, rid, "writeback copy failed")
            if far is not None:
                await self.store_tx.abort(far[0], far[1].tx_id, rid, "writeback copy failed")
            self.counters["writeback_failed"] += 1
            self._give_up(end)
            return
        if far is not None:
            await self._follow(h, far[1], end)
        elif self.follow_node is not None:
            self.follow_pending = True  # its store did not answer: try again next round
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

    async def _follow(self, here: TxHandle, far: TxHandle, end: int) -> None:
        """Ship the chain's blocks the prefill node lacks, up to ``end``, from this node's
        open transaction ``here`` into ``far`` on the prefill node, and commit there.
        Only behind the prompt's blocks, which that node committed itself; until then
        (the conductor commits them after the first token) the next round tries again."""
        rid = self.req.request_id
        if far.hit_blocks < self._prompt_blocks:
            await self.store_tx.abort(far.node, far.tx_id, rid, "prompt not on the prefill node")
            self.follow_pending = True
            return
        blocks = list(range(far.hit_blocks, end))
        try:
            if blocks:
                await self.store.ship_layer(here, far, 0, blocks, self.block_bytes, 0)
        except Exception as e:  # noqa: BLE001 - the far copy is lost, not the request
            log.warning("writeback_follow_failed", error=f"{type(e).__name__}: {e}")
            await self.store_tx.abort(far.node, far.tx_id, rid, "writeback ship failed")
            self.counters["writeback_follow_failed"] += 1
            self.follow_pending = True
            return
        if await self.store_tx.commit(far.node, far.tx_id, rid):
            self.counters["writeback_followed_blocks"] += len(blocks)
            self.follow_pending = False
        else:
            self.counters["writeback_follow_failed"] += 1
            self.follow_pending = True

    def _give_up(self, end: int) -> None:
        """A failed transaction: the chain has a hole at these blocks, so stop here."""
        self.enabled = False
        for j in list(self._bytes):
            if j < end:
                del self._bytes[j]
