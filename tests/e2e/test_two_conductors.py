"""Stateless conductor (paper §5.3): two conductors in one queue group place a burst of
requests with shared prefixes against the same stores at once. The stores are the only
authority, so: every request completes (stores short of room make the prefill
instances wait, never fail an accepted request), no block is double-allocated, every transaction is closed by commit or
rollback (none left to the lease), locks drop back to zero, and a conductor view built
afterwards from the nodes matches what they hold."""

import asyncio
import random
import uuid

import nats
import pytest

from bus_schemas import subjects
from bus_schemas.codec import decode, encode
from bus_schemas.control import DumpPage, DumpRequest, StoreInfo
from bus_schemas.placement import PrefillTask
from bus_schemas.requests import (
    Accepted,
    Error,
    ErrorCode,
    Finished,
    GenerateRequest,
    SamplingParams,
    stream_event_decoder,
)
from services.common import bus
from services.common.clock import WallClock
from services.conductor.shadow import ShadowView
from tests.e2e.conftest import make_stack
from tests.e2e.helpers import worker_stats

pytestmark = pytest.mark.e2e

BS = 32
REQUESTS = 24
MAX_TOKENS = 3
NODES = ("p0", "p1", "d0", "d1")


@pytest.fixture(scope="module")
def two_conductor_stack(tmp_path_factory):
    # 16 blocks per store, 10-block prompts: a node holds one request's slots and part
    # of another's, so in a burst of 24 the stores are often short of room (TxAllocate
    # refused with "capacity") and the prefill instances wait for running work to end.
    s = make_stack(
        tmp_path_factory,
        "two-conductors",
        engine="mock",
        prefill=2,
        decode=2,
        conductors=2,
        speedup="1",
        store_capacity_blocks=16,
        max_model_len=512,
    )
    s.start()
    yield s
    s.stop()


def prompts(rng: random.Random, vocab: int) -> list[list[int]]:
    shared = [[rng.randrange(3, vocab) for _ in range(4 * BS)] for _ in range(4)]
    return [
        shared[i % 4] + [rng.randrange(3, vocab) for _ in range(6 * BS)] for i in range(REQUESTS)
    ]


async def generate(nc, ids: list[int], rng: random.Random, log: dict) -> Finished:
    """Send until it completes; a 429/503 (refused allocation, early rejection) is retried."""
    dec = stream_event_decoder()
    for attempt in range(200):
        rid = f"two-{uuid.uuid4().hex[:10]}"
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        req = GenerateRequest(
            request_id=rid,
            prompt_token_ids=ids,
            reply_subject=inbox,
            sampling=SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
        )
        try:
            await nc.publish(subjects.REQUESTS, encode(req), reply=inbox)
            while True:
                ev = dec.decode((await sub.next_msg(timeout=60)).data)
                if isinstance(ev, Accepted):
                    log["cached"].append(ev.cached_tokens)
                elif isinstance(ev, Finished):
                    return ev
                elif isinstance(ev, Error):
                    assert ev.code in (ErrorCode.REJECTED, ErrorCode.UNAVAILABLE), ev
                    log["errors"].append(ev.message)
                    break
        finally:
            await sub.unsubscribe()
        await asyncio.sleep(rng.uniform(0.05, 0.2) * min(attempt + 1, 5))  # client back-off
    raise AssertionError("request never completed")


async def dump(nc, node: str) -> list[int]:
    hashes, cursor = [], 0
    while True:
        page = await bus.request(
            nc,
            subjects.store_ctl(node, "dump"),
            DumpRequest(cursor=cursor, limit=7),
            DumpPage,
            timeout=5,
        )
        hashes.extend(page.block_hashes)
        if page.next_cursor is None:
            return hashes
        cursor = page.next_cursor


async def idle_stats(url: str, timeout: float = 20.0) -> dict[str, dict[str, int]]:
    """Store counters once every node is idle (the last commits follow the last tokens)."""

    async def poll():
        while True:
            stats = {n: await worker_stats(url, "store", n) for n in NODES}
            if all(s["open_txs"] == 0 and s["locked_blocks"] == 0 for s in stats.values()):
                return stats
            await asyncio.sleep(0.1)

    return await asyncio.wait_for(poll(), timeout)


async def test_two_conductors_share_the_stores_without_double_allocation(two_conductor_stack):
    s = two_conductor_stack
    rng = random.Random(5)
    nc = await nats.connect(s.nats_url)
    placed_by: list[str] = []

    async def on_task(m):
        placed_by.append(decode(m.data, PrefillTask).conductor_id)

    await nc.subscribe("perigee.prefill.*.tasks", cb=on_task)
    await nc.flush()
    log: dict[str, list] = {"cached": [], "errors": []}
    try:
        results = await asyncio.wait_for(
            asyncio.gather(
                *(
                    generate(nc, ids, random.Random(i), log)
                    for i, ids in enumerate(prompts(rng, 1024))
                )
            ),
            240,
        )
        # none lost: every request finished in full
        assert len(results) == REQUESTS
        assert all(
            r.finish_reason == "length" and r.completion_tokens == MAX_TOKENS for r in results
        )
        # both conductors placed work
        assert set(placed_by) == {"conductor-0", "conductor-1"}

        stats = await idle_stats(s.nats_url)
        # stores were short of room, and that never failed an accepted request (the
        # prefill instances waited for running work to free slots)
        assert sum(st["tx_refused"] for st in stats.values()) > 0, stats
        assert not [e for e in log["errors"] if "capacity" in e or "reservation" in e], log
        for node, st in stats.items():
            # every transaction closed by commit or rollback, none left to the lease
            assert st["tx_allocated"] == st["tx_committed"] + st["tx_aborted"], (node, st)
            assert st["tx_expired"] == 0, (node, st)
            # refcounts back to zero, nothing owned by a transaction
            assert st["locked_blocks"] == 0 and st["tx_owned_blocks"] == 0, (node, st)
            # every used slot holds exactly one cached block, each hash at most once
            held = await dump(nc, node)
            assert len(held) == len(set(held)) == st["cached_blocks"] == st["used_blocks"], (
                node,
                st,
            )

        # a conductor that starts now rebuilds the same view (from the KV-event stream,
        # a node's dump where the stream falls short)
        subs = bus.Subscriptions(nc)
        view = ShadowView(nc, subs, WallClock())
        await view.start(discover_window_s=1.0)
        infos = {
            n: await bus.request(nc, subjects.store_ctl(n, "info"), b"", StoreInfo, timeout=5)
            for n in NODES
        }

        async def synced():
            while not view.caught_up.is_set() or any(
                view.index.resyncing(n) or view.index.state(n) != (i.epoch, i.seq)
                for n, i in infos.items()
            ):
                await asyncio.sleep(0.05)

        await asyncio.wait_for(synced(), 15)
        for node in NODES:
            assert view.index.blocks(node) == frozenset(await dump(nc, node)), node
        await subs.close()
    finally:
        await nc.close()


# --------------------------------------------------------------- live role switch (§5.1)


@pytest.fixture(scope="module")
def switchable_stack(tmp_path_factory):
    s = make_stack(
        tmp_path_factory,
        "switchable",
        engine="mock",
        prefill=2,
        decode=1,
        speedup="100",
        switchable=True,
    )
    s.start()
    yield s
    s.stop()


async def test_a_switchable_prefill_worker_becomes_a_decode_instance(switchable_stack):
    from bus_schemas.control import RoleSwitch

    s = switchable_stack
    nc = await nats.connect(s.nats_url)
    became_decode = asyncio.Event()

    async def on_load(_m):
        became_decode.set()

    try:
        await nc.subscribe(subjects.load_report("decode", "prefill-1"), cb=on_load)
        await nc.flush()
        await nc.publish(subjects.CTL_ROLE, encode(RoleSwitch(instance="prefill-1", role="decode")))
        await asyncio.wait_for(became_decode.wait(), 20)
        accepted: list[Accepted] = []
        dec = stream_event_decoder()

        async def one(i: int) -> Finished:
            inbox = nc.new_inbox()
            sub = await nc.subscribe(inbox)
            ids = [3 + (i * 7 + k) % 1000 for k in range(100)]
            req = GenerateRequest(
                request_id=f"sw-{i}-{uuid.uuid4().hex[:6]}",
                prompt_token_ids=ids,
                reply_subject=inbox,
                sampling=SamplingParams(max_tokens=20, ignore_eos=True),
            )
            await nc.publish(subjects.REQUESTS, encode(req), reply=inbox)
            try:
                while True:
                    ev = dec.decode((await sub.next_msg(timeout=30)).data)
                    if isinstance(ev, Accepted):
                        accepted.append(ev)
                    elif isinstance(ev, Finished | Error):
                        return ev
            finally:
                await sub.unsubscribe()

        # Back-to-back placements spread over the decode pool, which now has two members.
        done = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(6))), 60)
        assert all(isinstance(r, Finished) and r.completion_tokens == 20 for r in done), done
        assert {a.prefill_instance for a in accepted} == {"prefill-0"}
        assert "prefill-1" in {a.decode_instance for a in accepted}
        assert not s.exited()
    finally:
        await nc.close()
