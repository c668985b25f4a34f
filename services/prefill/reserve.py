"""The prefill instance's store reservations: opened when a request's compute starts,
never while it waits in the queue, and kept alive by lease renewal until they are
handed on.

    reserve    TxAllocate PREFILL (own node), DECODE (decode node) and SOURCE (the
               holder of a remote prefix), in parallel (the first round's answers
               come from services.prefill.reserve_ahead when the conductor sent it).
               A store short of room (every slot held by running work) is asked
               again, every ``retry_s``, keeping what was granted, for up to
               ``wait_s``: an accepted request waits for room rather than fail. A
               store that does not answer fails the request.
    hold       every granted transaction is renewed by the LeaseKeeper
    hand_off   the decode transaction goes to the decode instance in the DecodeTask,
               the prefill and source ones to the conductor's commit: renewals stop
    release    on failure: TxAbort on everything reserved
"""

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import structlog

from bus_schemas.control import TxAllocate, TxHandle
from bus_schemas.placement import PrefillTask, RemotePrefix
from services.common import reservation as plan
from services.common.clock import Clock, SleepFn, WallClock
from services.common.kv_errors import STORE_UNAVAILABLE
from services.common.store_tx import AllocationRound, LeaseKeeper, StoreTx

log = structlog.get_logger()


class ReserveError(Exception):
    """The request's slots could not be had: ``reason`` is "capacity" (still no room
    after waiting) or "unavailable" (a store did not answer or refused otherwise)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Reservation:
    """A request's open transactions: prefill, decode and the remote prefix to pull."""

    prefill_tx: TxHandle
    decode_tx: TxHandle
    remote: RemotePrefix | None = None  # what to pull, under a SOURCE transaction

    @property
    def prefix_blocks(self) -> int:
        """Leading blocks whose KV is on the prefill node before compute: the local hit,
        extended by the pulled ones."""
        return self.grant.prefix_blocks

    @property
    def grant(self) -> plan.ReservationGrant:
        """What the transactions mean for the compute (services.common.reservation)."""
        r = self.remote
        pull = (r.first_block, r.num_blocks) if r else None
        return plan.ReservationGrant(
            prefix_blocks=plan.prefix_after(self.prefill_tx.hit_blocks, pull),
            pull=pull,
            ship_from_block=self.decode_tx.hit_blocks,
        )

    def txs(self) -> list[tuple[str, str]]:
        out = [
            (self.prefill_tx.node, self.prefill_tx.tx_id),
            (self.decode_tx.node, self.decode_tx.tx_id),
        ]
        if self.remote is not None:
            out.append((self.remote.source_node, self.remote.source_tx.tx_id))
        return out


T = TypeVar("T")


class Reserver(Protocol):
    """What the prefill worker asks of its store reservations, from open to release."""

    async def reserve(
        self, task: PrefillTask, ahead: Awaitable[AllocationRound] | None = None
    ) -> Reservation: ...
    async def computing(self, r: Reservation, work: Awaitable[T]) -> T: ...
    def prefill_committed(self, r: Reservation) -> None: ...
    async def hand_off(self, task: PrefillTask, r: Reservation) -> None: ...
    async def release(self, task: PrefillTask, r: Reservation, reason: str) -> None: ...
    async def close(self) -> None: ...


class StoreReserver:
    """:class:`Reserver` over the stores' NATS control endpoints."""

    def __init__(
        self,
        tx: StoreTx,
        *,
        lease_s: float,
        wait_s: float = plan.WAIT_S,
        retry_s: float = plan.RETRY_S,
        clock: Clock | None = None,
        sleep: SleepFn = asyncio.sleep,
    ) -> None:
        self.tx = tx
        self.clock: Clock = clock or WallClock()
        self.sleep = sleep
        self.leases = LeaseKeeper(tx, lease_s)
        self.lease_s = lease_s
        self.wait_s = wait_s
        self.retry_s = retry_s

    def _jobs(self, task: PrefillTask, roles: set[str]) -> dict[str, tuple[str, TxAllocate]]:
        return plan.allocations(task, roles, self.lease_s)

    async def reserve(
        self, task: PrefillTask, ahead: Awaitable[AllocationRound] | None = None
    ) -> Reservation:
        """``ahead``: the first round's answers, when the conductor sent it
        (services.prefill.reserve_ahead); a role they leave out is asked here."""
        rid = task.request.request_id
        want = plan.wanted(task.source)
        got = AllocationRound()
        give_up = self.clock.now() + self.wait_s
        waited = False
        try:
            while True:
                jobs = self._jobs(task, want - set(got.handles))
                if ahead is not None:
                    att, ahead = await ahead, None
                    rest = {r: j for r, j in jobs.items() if not att.answered(r)}
                    if rest:
                        att.merge(await self.tx.allocate(rest))
                else:
                    att = await self.tx.allocate(jobs)
                for role, (node, h) in att.handles.items():
                    got.handles[role] = (node, h)
                    self.leases.hold(rid, node, h)
                v = plan.next_step(att.refused, att.failed)
                if v.drop_source:
                    # The holder no longer has the prefix (evicted while the request
                    # queued, nothing being locked then) or is gone: compute it here.
                    log.info(
                        "source_dropped",
                        node=task.source.node if task.source else "",
                        reason=att.refused.get("source") or att.failed.get("source"),
                    )
                    want.discard(plan.SOURCE)
                if v.step is plan.ReservationStep.FAIL:
                    raise ReserveError("unavailable", f"{STORE_UNAVAILABLE} ({v.detail})")
                if v.step is plan.ReservationStep.DONE:
                    break
                if self.clock.now() >= give_up:
                    raise ReserveError(
                        "capacity",
                        "no room in the store for the request's "
                        f"KV after {self.wait_s:.0f} s ({v.detail})",
                    )
                if not waited:
                    log.info("reserve_waiting_for_room", refused=v.detail)
                    waited = True
                await self.sleep(self.retry_s)
        except BaseException:
            await self._abort(got, rid, "reservation failed")
            raise
        return await self._finish(task, got)

    async def _finish(self, task: PrefillTask, got: AllocationRound) -> Reservation:
        rid = task.request.request_id
        ptx, dtx = got.handles[plan.PREFILL][1], got.handles[plan.DECODE][1]
        remote = None
        if plan.SOURCE in got.handles:
            node, stx = got.handles[plan.SOURCE]
            g = plan.grant(task.source, prefill_hit=ptx.hit_blocks, source_granted=True)
            if g.pull is None:  # the prefill node already has it all: nothing to pull
                self.leases.drop(node, stx.tx_id)
                await self.tx.abort(node, stx.tx_id, rid, "not needed")
            else:
                remote = RemotePrefix(
                    source_node=node, source_tx=stx, first_block=g.pull[0], num_blocks=g.pull[1]
                )
        return Reservation(prefill_tx=ptx, decode_tx=dtx, remote=remote)

    async def computing(self, r: Reservation, work: Awaitable[T]) -> T:
        """``work`` (the engine writing the prompt's KV into the prefill tx's slots) while
        the store keeps them; a lease that ends first cancels it (``LeaseExpired``)."""
        return await self.leases.before_expiry((r.prefill_tx.node, r.prefill_tx.tx_id), work)

    def prefill_committed(self, r: Reservation) -> None:
        """Its store committed the prefill tx with the last ship: no lease to renew (a
        renewal now would find it gone and call the lease lost)."""
        self.leases.drop(r.prefill_tx.node, r.prefill_tx.tx_id)

    async def hand_off(self, task: PrefillTask, r: Reservation) -> None:
        for node, tx_id in r.txs():
            self.leases.drop(node, tx_id)

    async def release(self, task: PrefillTask, r: Reservation, reason: str) -> None:
        for node, tx_id in r.txs():
            self.leases.drop(node, tx_id)
        await self.tx.abort_many(r.txs(), task.request.request_id, reason)

    async def _abort(self, got: AllocationRound, rid: str, reason: str) -> None:
        for node, h in got.handles.values():
            self.leases.drop(node, h.tx_id)
        await self.tx.abort_all(rid, got, reason)

    async def close(self) -> None:
        await self.leases.close()
