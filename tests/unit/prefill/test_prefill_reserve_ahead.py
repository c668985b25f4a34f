"""services.prefill.reserve_ahead against tiny store responders on a real nats-server:
the first reservation round a conductor sends ahead of a task, answered to the prefill
instance, taken as the reservation's; what nobody takes is aborted."""

import asyncio
from collections.abc import Callable

import msgspec
import pytest

from bus_schemas import subjects
from bus_schemas.codec import encode
from bus_schemas.placement import PrefillTask
from services.common import reservation
from services.common.bus import sync
from services.common.store_tx import StoreTx
from services.prefill.reserve import ReserveError, StoreReserver
from services.prefill.reserve_ahead import AheadReplies
from tests.unit.prefill.test_prefill_reserve import HASHES, Store, task

BOTH = {reservation.PREFILL, reservation.DECODE}


async def send_ahead(nc, t: PrefillTask, roles: set[str]) -> None:
    """What ConductorService._reserve_ahead sends for ``t``."""
    for role, (node, msg) in reservation.allocations(t, roles, 10.0).items():
        reply = subjects.prefill_reserved(t.prefill_instance, t.reserved_ahead, role)
        await nc.publish(subjects.store_ctl(node, "tx.allocate"), encode(msg), reply=reply)
    await nc.flush()


async def booked(nc, **kw) -> AheadReplies:
    book = AheadReplies(StoreTx(nc, timeout_s=1.0), lease_s=10.0, **kw)
    await nc.subscribe(subjects.prefill_reserved("prefill-0"), cb=book.on_reply)
    await sync(nc)
    return book


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.01)


def ahead(key: str, **kw) -> PrefillTask:
    return msgspec.structs.replace(task(**kw), reserved_ahead=key)


async def test_the_round_sent_ahead_is_the_reservation(conns):
    store_nc, worker_nc = conns
    p0, d0 = (
        await Store(store_nc, "p0", held=HASHES[:1]).start(),
        await Store(store_nc, "d0").start(),
    )
    book, r = await booked(worker_nc), StoreReserver(StoreTx(worker_nc), lease_s=10.0)
    t = ahead("k1")
    await send_ahead(store_nc, t, BOTH)
    res = await r.reserve(t, ahead=book.take("k1", "r1", BOTH))
    assert len(p0.allocs) == len(d0.allocs) == 1  # nobody asked twice
    assert res.prefill_tx.tx_id in p0.open and res.decode_tx.tx_id in d0.open
    assert res.prefill_tx.hit_blocks == 1 and not p0.aborts and not d0.aborts
    assert (book.counters["ahead_taken"], book.counters["ahead_missing"]) == (1, 0)
    await r.close()
    await book.close()


async def test_a_role_not_answered_is_allocated_here_and_its_late_answer_aborted(conns):
    store_nc, worker_nc = conns
    p0, d0 = await Store(store_nc, "p0").start(), await Store(store_nc, "d0").start()
    book, r = await booked(worker_nc, wait_s=0.05), StoreReserver(StoreTx(worker_nc), lease_s=10.0)
    t = ahead("k2")
    await send_ahead(store_nc, t, {reservation.PREFILL})  # the decode node's never went
    res = await r.reserve(t, ahead=book.take("k2", "r1", BOTH))
    assert len(p0.allocs) == 1 and len(d0.allocs) == 1  # the worker asked d0 itself
    assert res.decode_tx.tx_id in d0.open and book.counters["ahead_missing"] == 1
    await send_ahead(store_nc, t, {reservation.DECODE})  # now it comes: nobody needs it
    await until(lambda: len(d0.aborts) == 1)
    assert d0.aborts[0] != res.decode_tx.tx_id and res.decode_tx.tx_id in d0.open
    await r.close()
    await book.close()


async def test_a_task_that_ends_first_aborts_what_came_and_what_comes(conns):
    store_nc, worker_nc = conns
    p0, d0 = await Store(store_nc, "p0").start(), await Store(store_nc, "d0").start()
    book = await booked(worker_nc)
    t = ahead("k3")
    await send_ahead(store_nc, t, {reservation.PREFILL})
    await until(lambda: book.answers("k3") == 1)
    book.drop("k3", "cancelled")  # e.g. cancelled while queued
    await until(lambda: len(p0.aborts) == 1)
    assert not p0.open
    await send_ahead(store_nc, t, {reservation.DECODE})
    await until(lambda: len(d0.aborts) == 1)
    assert not d0.open and book.counters["ahead_aborted"] == 2
    await book.close()


async def test_a_node_with_no_store_fails_the_reservation_as_the_workers_own_round(conns):
    # Nobody answers an allocation sent ahead to a node without a store (the server's
    # no-responders goes to the sender only, the conductor): once the other store of
    # the round answered, the worker waits straggler_s, not wait_s, asks itself, is
    # told no store listens, and fails the request; what was granted goes back.
    store_nc, worker_nc = conns
    p0 = await Store(store_nc, "p0").start()
    book = await booked(worker_nc, wait_s=3600.0, straggler_s=0.05)
    r = StoreReserver(StoreTx(worker_nc), lease_s=10.0)
    t = ahead("k4", nodes=("p0", "gone"))
    await send_ahead(store_nc, t, BOTH)
    with pytest.raises(ReserveError) as e:
        async with asyncio.timeout(30):  # wait_s would be an hour
            await r.reserve(t, ahead=book.take("k4", "r1", BOTH))
    assert e.value.reason == "unavailable" and book.counters["ahead_missing"] == 1
    await until(lambda: len(p0.aborts) == 1)
    assert not p0.open and len(p0.allocs) == 1
    await r.close()
    await book.close()


async def test_the_straggler_wait_starts_with_the_rounds_first_answer(conns):
    # A task taken long before any answer (the stores are slow, not dead) waits for
    # them up to wait_s: straggler_s counts from the first answer, not from the take.
    store_nc, worker_nc = conns
    p0, d0 = await Store(store_nc, "p0").start(), await Store(store_nc, "d0").start()
    now = [0.0]
    book = await booked(worker_nc, wait_s=3600.0, straggler_s=0.05, clock=lambda: now[0])
    t = ahead("k6")
    taking = asyncio.create_task(book.take("k6", "r1", BOTH))
    await until(lambda: "k6" in book._keys)  # the take is waiting
    now[0] = 10.0  # far past straggler_s, no answer yet
    await send_ahead(store_nc, t, BOTH)
    round_ = await taking
    assert set(round_.handles) == BOTH and book.counters["ahead_missing"] == 0
    assert not p0.aborts and not d0.aborts
    await book.close()


async def test_answers_no_task_takes_are_given_back_after_forget_s(conns):
    # The task was lost on its way (or resent without its key): nobody would take the
    # answers, and their leases would otherwise be renewed for ever.
    store_nc, worker_nc = conns
    p0, d0 = await Store(store_nc, "p0").start(), await Store(store_nc, "d0").start()
    now = [0.0]
    book = await booked(worker_nc, forget_s=30.0, clock=lambda: now[0])
    await send_ahead(store_nc, ahead("k5"), BOTH)
    await until(lambda: book.answers("k5") == 2)
    now[0] = 29.0
    book.sweep()
    assert book.answers("k5") == 2 and not p0.aborts  # not yet
    now[0] = 31.0
    book.sweep()
    await until(lambda: len(p0.aborts) == len(d0.aborts) == 1)
    assert book.answers("k5") == 0 and not p0.open and not d0.open
    await book.close()
