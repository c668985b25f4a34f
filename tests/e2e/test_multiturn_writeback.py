"""Decode write-back on a real stack (mock engine): a conversation's next turn reuses
the previous answer's blocks, which the decode worker stored and announced."""

import uuid

import nats
import numpy as np
import pytest

from bus_schemas import subjects
from bus_schemas.codec import decode, encode
from bus_schemas.kv_events import BlockStored, EventBatch
from bus_schemas.requests import Finished, GenerateRequest, SamplingParams, StreamEvent, Tokens
from services.common.hashing import block_hashes
from tests.e2e.helpers import KVEventWatcher, worker_stats

pytestmark = pytest.mark.e2e


async def turn(nc, prompt: list[int], max_tokens: int) -> tuple[list[int], Finished]:
    """One greedy request on the bus: (its tokens, its Finished)."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    req = GenerateRequest(
        request_id=uuid.uuid4().hex,
        prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )
    await nc.publish(subjects.REQUESTS, encode(req), reply=inbox)
    toks: list[int] = []
    try:
        while True:
            ev = decode((await sub.next_msg(timeout=60)).data, StreamEvent)
            if isinstance(ev, Tokens):
                toks += ev.token_ids
            elif isinstance(ev, Finished):
                return toks, ev
            elif type(ev).__name__ == "Error":
                raise AssertionError(ev)
    finally:
        await sub.unsubscribe()


class NodeWatcher(KVEventWatcher):
    """The blocks one node's store announced."""

    def __init__(self, node: str) -> None:
        super().__init__()
        self.node = node

    async def start(self, nats_url: str) -> "NodeWatcher":
        self.nc = await nats.connect(nats_url)

        async def cb(m):
            batch = decode(m.data, EventBatch)
            if batch.node == self.node:
                for ev in batch.events:
                    if isinstance(ev, BlockStored):
                        self.stored.update(ev.block_hashes)
                self._changed.set()

        await self.nc.subscribe(subjects.KV_EVENTS_ALL, cb=cb)
        return self


def ids(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 900, n)]


async def test_next_turn_reuses_the_previous_answer(stack):
    bs = stack.cfg.block_size
    nc = await nats.connect(stack.nats_url)
    # The prefill node: the answer follows the prompt there (the next turn's placement
    # finds the whole conversation on one node).
    watcher = await NodeWatcher("p0").start(stack.nats_url)
    before = await worker_stats(stack.nats_url, "decode", "decode-0")
    try:
        p1 = ids(5 * bs + 7, seed=2401)
        a1, f1 = await turn(nc, p1, 3 * bs)
        conv = p1 + a1
        # Every full block with KV (all but the last sampled token) is stored there and
        # announced.
        full = (len(conv) - 1) // bs
        await watcher.wait_for(block_hashes(conv, bs)[:full])
        p2 = conv + ids(bs // 2, seed=2402)
        a2, f2 = await turn(nc, p2, 8)
    finally:
        await watcher.close()
        await nc.close()
    after = await worker_stats(stack.nats_url, "decode", "decode-0")
    assert f1.finish_reason == "length" and len(a1) == 3 * bs
    assert after["writeback_blocks"] - before.get("writeback_blocks", 0) >= full - len(p1) // bs
    assert f2.cached_tokens >= full * bs, (f2.cached_tokens, full * bs)
