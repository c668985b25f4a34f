"""StoreReserver and LeaseKeeper against tiny store responders on a real nats-server:
what is opened when, waiting for room, what is rolled back, what is renewed."""

import asyncio
import itertools
import time

import pytest

from bus_schemas import subjects
from bus_schemas.codec import decode, encode
from bus_schemas.control import (
    Refused,
    TxAbort,
    TxAllocate,
    TxDone,
    TxHandle,
    TxRenew,
    TxRenewed,
    TxRole,
)
from bus_schemas.placement import PrefillTask, PrefixSource
from bus_schemas.requests import GenerateRequest
from services.common.bus import sync
from services.common.clock import ManualClock
from services.common.hashing import block_hashes
from services.common.store_tx import LeaseExpired, StoreTx
from services.prefill.reserve import ReserveError, StoreReserver

BS = 32
PROMPT = list(range(1, 101))  # 3 full blocks and a 4-token tail
HASHES = block_hashes(PROMPT, BS)
_ids = itertools.count(1)


class Store:
    """A node's tx.allocate/abort/renew: grants (hit = leading ``held`` hashes) after
    refusing ``refuse`` times with "capacity"; records everything."""

    def __init__(self, nc, node: str, held=(), refuse: int = 0) -> None:
        self.nc, self.node, self.held, self.refuse = nc, node, list(held), refuse
        self.allocs: list[TxAllocate] = []
        self.aborts: list[str] = []
        self.renewals: list[TxRenew] = []
        self.open: set[str] = set()

    async def start(self) -> "Store":
        async def allocate(m):
            a = decode(m.data, TxAllocate)
            self.allocs.append(a)
            if self.refuse > 0:
                self.refuse -= 1
                return await self.nc.publish(
                    m.reply, encode(Refused(reason="capacity", message=""))
                )
            hit = 0
            while hit < len(a.block_hashes) and a.block_hashes[hit] in self.held:
                hit += 1
            n = len(a.block_hashes) if a.role == TxRole.SOURCE else -(-a.num_tokens // BS)
            h = TxHandle(
                tx_id=f"{self.node}-tx{next(_ids)}",
                node=self.node,
                epoch=1,
                slots=list(range(n)),
                hit_blocks=hit,
                shm_name="",
                data_addr="",
                block_bytes=1,
                expires_at=time.time() + a.lease_s,
            )
            self.open.add(h.tx_id)
            await self.nc.publish(m.reply, encode(h))

        async def abort(m):
            a = decode(m.data, TxAbort)
            self.aborts.append(a.tx_id)
            self.open.discard(a.tx_id)
            await self.nc.publish(m.reply, encode(TxDone(tx_id=a.tx_id)))

        async def renew(m):
            r = decode(m.data, TxRenew)
            self.renewals.append(r)
            ok = [t for t in r.tx_ids if t in self.open]
            await self.nc.publish(
                m.reply,
                encode(
                    TxRenewed(
                        expires_at=time.time() + r.lease_s,
                        renewed=ok,
                        unknown=[t for t in r.tx_ids if t not in ok],
                    )
                ),
            )

        for ep, cb in (("tx.allocate", allocate), ("tx.abort", abort), ("tx.renew", renew)):
            await self.nc.subscribe(subjects.store_ctl(self.node, ep), cb=cb)
        await sync(self.nc)  # one flush's PING may overtake the SUBs (a no-responders flake)
        return self


def task(source: PrefixSource | None = None, nodes=("p0", "d0")) -> PrefillTask:
    req = GenerateRequest(
        request_id="r1", prompt_token_ids=PROMPT, block_hashes=HASHES, block_size=BS
    )
    return PrefillTask(
        request=req,
        conductor_id="c",
        prefill_instance="prefill-0",
        decode_instance="decode-0",
        prefill_node=nodes[0],
        decode_node=nodes[1],
        source=source,
    )


def reserver(nc, **kw) -> StoreReserver:
    return StoreReserver(
        StoreTx(nc, timeout_s=1.0),
        lease_s=kw.pop("lease_s", 30.0),
        retry_s=kw.pop("retry_s", 0.01),
        **kw,
    )


async def test_reserve_opens_prefill_decode_and_source_and_pulls_from_the_local_hit(conns):
    snc, wnc = conns
    p = await Store(snc, "p0", held=HASHES[:1]).start()
    d = await Store(snc, "d0").start()
    r = await Store(snc, "r0", held=HASHES).start()
    res_ = reserver(wnc)
    res = await res_.reserve(task(PrefixSource(node="r0", first_block=0, num_blocks=3)))
    assert [a.role for a in p.allocs] == [TxRole.PREFILL]
    assert [a.role for a in d.allocs] == [TxRole.DECODE]
    assert [(a.role, a.block_hashes, a.num_tokens) for a in r.allocs] == [
        (TxRole.SOURCE, HASHES, 96)
    ]
    assert res.prefill_tx.hit_blocks == 1 and res.remote is not None
    assert (res.remote.first_block, res.remote.num_blocks) == (1, 2)  # from the local hit on
    assert res.prefix_blocks == 3
    assert res_.leases.held == 3
    # committed with the last ship: its lease is not renewed any more, the others are
    res_.prefill_committed(res)
    assert res_.leases.held == 2 and ("p0", res.prefill_tx.tx_id) not in res_.leases._held
    await res_.hand_off(task(), res)
    assert res_.leases.held == 0 and p.aborts == d.aborts == r.aborts == []
    await res_.close()


async def test_source_the_prefill_node_no_longer_needs_is_aborted(conns):
    snc, wnc = conns
    await Store(snc, "p0", held=HASHES).start()
    await Store(snc, "d0").start()
    r = await Store(snc, "r0", held=HASHES).start()
    res_ = reserver(wnc)
    res = await res_.reserve(task(PrefixSource(node="r0", first_block=0, num_blocks=3)))
    assert res.remote is None and res.prefix_blocks == 3
    assert len(r.aborts) == 1 and res_.leases.held == 2
    await res_.close()


async def test_a_full_store_is_waited_for_keeping_what_was_granted(conns):
    snc, wnc = conns
    p = await Store(snc, "p0").start()
    d = await Store(snc, "d0", refuse=3).start()
    res_ = reserver(wnc)
    res = await res_.reserve(task())
    assert len(p.allocs) == 1 and len(d.allocs) == 4  # only the refused side asked again
    assert p.aborts == [] and res.decode_tx.node == "d0"
    await res_.close()


async def test_still_no_room_after_waiting_fails_and_rolls_back(conns):
    snc, wnc = conns
    p = await Store(snc, "p0").start()
    await Store(snc, "d0", refuse=10**6).start()
    clock = ManualClock()
    waits: list[float] = []

    async def sleep(dt: float) -> None:  # the reserver's wait, on its own clock
        waits.append(dt)
        clock.advance(dt)

    res_ = reserver(wnc, wait_s=60.0, retry_s=1.0, clock=clock, sleep=sleep)
    with pytest.raises(ReserveError) as e:
        await res_.reserve(task())
    assert e.value.reason == "capacity" and "after 60 s" in str(e.value)
    # It asked again every retry_s until the wait was spent, and not past it.
    assert waits == [1.0] * 60 and clock.now() == 60.0
    assert len(p.aborts) == 1 and p.open == set()
    assert res_.leases.held == 0
    await res_.close()


async def test_a_store_that_does_not_answer_fails_at_once_and_rolls_back(conns):
    snc, wnc = conns
    p = await Store(snc, "p0").start()
    res_ = reserver(wnc)
    with pytest.raises(ReserveError) as e:
        await res_.reserve(task(nodes=("p0", "nowhere")))
    assert e.value.reason == "unavailable" and "decode" in str(e.value)
    assert len(p.aborts) == 1 and p.open == set() and res_.leases.held == 0
    await res_.close()


async def test_leases_are_renewed_per_node_and_a_lost_one_is_reported(conns):
    snc, wnc = conns
    p = await Store(snc, "p0").start()
    d = await Store(snc, "d0").start()
    res_ = reserver(wnc, lease_s=30.0)
    res = await res_.reserve(task())
    await res_.leases.renew_now()
    assert [r.tx_ids for r in p.renewals] == [[res.prefill_tx.tx_id]]
    assert [r.tx_ids for r in d.renewals] == [[res.decode_tx.tx_id]]
    d.open.clear()  # the decode store restarted: it no longer knows the tx
    await res_.leases.renew_now()
    key = ("d0", res.decode_tx.tx_id)
    assert res_.leases.lost == {key} and res_.leases.expires_at(*key) == 0.0
    assert res_.leases.expires_at("p0", res.prefill_tx.tx_id) > time.time() + 20
    await res_.release(task(), res, "test")
    assert res_.leases.held == 0 and p.aborts == [res.prefill_tx.tx_id]
    await res_.close()


async def test_the_compute_runs_only_while_the_prefill_lease_holds(conns):
    # A compute that finishes under a live lease returns its result; one running when a
    # renewal finds the tx gone (the store restarted) is cancelled and LeaseExpired
    # raised, so the engine stops writing into slots the store may have handed on.
    snc, wnc = conns
    p = await Store(snc, "p0").start()
    await Store(snc, "d0").start()
    res_ = reserver(wnc, lease_s=30.0)
    res = await res_.reserve(task())

    async def quick() -> int:
        return 7

    assert await res_.computing(res, quick()) == 7
    started, never = asyncio.Event(), asyncio.Event()
    cancelled = []

    async def slow() -> int:
        started.set()
        try:
            await never.wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        return 0

    guarded = asyncio.create_task(res_.computing(res, slow()))
    await started.wait()
    assert not guarded.done()
    p.open.clear()  # the prefill store restarted: it no longer knows the tx
    await res_.leases.renew_now()
    with pytest.raises(LeaseExpired):
        await guarded
    assert cancelled == [True]
    await res_.release(task(), res, "test")
    await res_.close()


async def test_a_source_that_no_longer_answers_is_dropped_and_the_prefix_computed(conns):
    # Nothing is locked while a request queues, so the holder may have evicted the
    # prefix (or gone) by the time its compute starts: that is no reason to fail it.
    snc, wnc = conns
    p = await Store(snc, "p0").start()
    d = await Store(snc, "d0", refuse=2).start()
    res_ = reserver(wnc)
    res = await res_.reserve(task(PrefixSource(node="gone", first_block=0, num_blocks=3)))
    assert res.remote is None and res.prefix_blocks == 0
    assert len(p.allocs) == 1 and len(d.allocs) == 3 and p.aborts == []
    assert res_.leases.held == 2
    await res_.close()
