"""The client side of the stores' transactions (paper §5.3, Fig. 9), for whoever holds
a request's slots: the prefill worker opens them when its compute starts, the decode
worker holds the decode side until its engine has the KV, the conductor commits and
aborts by the ids in the workers' notices.

One reservation opens up to three transactions, all in parallel: PREFILL on the
prefill node (lock the cached prefix, allocate the rest), DECODE on the decode node (a
slot for every block), SOURCE on the holder of a remote prefix (lock only). Their
leases are short and renewed by :class:`LeaseKeeper` while the holder works, so a
dead holder leaks nothing for long and a live one never loses its slots by waiting.
Store requests never raise here: a timeout or missing store is an error string.
"""

import asyncio
import time
from collections import defaultdict
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import structlog
from nats.aio.client import Client as NATS

from bus_schemas import subjects
from bus_schemas.control import (
    Refused,
    TxAbort,
    TxAllocate,
    TxCommit,
    TxDone,
    TxDoneReply,
    TxHandle,
    TxRenew,
    TxRenewed,
    TxReply,
)
from services.common import bus

log = structlog.get_logger()

T = TypeVar("T")

# Renewals keep a lease's end ahead while the store answers; a holder gives its slots up
# this long before the end it knows of: the store's sweep runs every 0.25 s, an engine
# already copying needs a moment, clocks of two hosts may differ.
LEASE_MARGIN_S = 2.0


class LeaseExpired(Exception):
    """A transaction's lease ended (the store stopped answering, or lost it in a restart)
    before the holder was done with its slots."""


@dataclass
class AllocationRound:
    """Outcome of one round of TxAllocate, by role ("prefill", "decode", "source")."""

    handles: dict[str, tuple[str, TxHandle]] = field(default_factory=dict)  # role -> (node, handle)
    refused: dict[str, str] = field(default_factory=dict)  # role -> Refused.reason
    failed: dict[str, str] = field(default_factory=dict)  # role -> error (timeout, no store)

    def broke(self, role: str) -> bool:
        return role in self.refused or role in self.failed

    def answered(self, role: str) -> bool:
        """Whether ``role`` has an outcome in this round (a grant, a refusal, a failure)."""
        return role in self.handles or self.broke(role)

    def merge(self, more: "AllocationRound") -> None:
        """Add ``more``'s outcomes (another round's, for other roles) to this one."""
        self.handles.update(more.handles)
        self.refused.update(more.refused)
        self.failed.update(more.failed)


@dataclass(frozen=True)
class Unanswered:
    """A store request that got no usable reply: a timeout, no responders, an error
    reply or one that does not decode."""

    reason: str


class StoreTx:
    """Opens, commits and aborts store transactions over NATS; answers are values, never raised."""

    def __init__(self, nc: NATS, *, timeout_s: float = 2.0) -> None:
        self.nc = nc
        self.timeout_s = timeout_s

    async def allocate(self, jobs: dict[str, tuple[str, TxAllocate]]) -> AllocationRound:
        """Send every role's TxAllocate to its node at once; what each answered."""
        replies = await asyncio.gather(
            *(self._request(node, "tx.allocate", msg, TxReply) for node, msg in jobs.values())
        )
        out = AllocationRound()
        for (role, (node, _)), rep in zip(jobs.items(), replies, strict=True):
            if isinstance(rep, TxHandle):
                out.handles[role] = (node, rep)
            elif isinstance(rep, Refused):
                out.refused[role] = rep.reason
            else:
                out.failed[role] = rep.reason if isinstance(rep, Unanswered) else repr(rep)
        return out

    async def commit(self, node: str, tx_id: str, request_id: str) -> bool:
        rep = await self._request(
            node, "tx.commit", TxCommit(tx_id=tx_id, request_id=request_id), TxDoneReply
        )
        if not isinstance(rep, TxDone):
            log.warning("commit_failed", node=node, tx_id=tx_id, reply=repr(rep))
            return False
        return True

    async def commit_unanswered(self, node: str, tx_id: str, request_id: str) -> None:
        """Commit without waiting for the outcome, for a committer that would only log
        it: the store logs a refusal itself, and a commit lost on the way leaves the tx
        to its lease, rolled back at expiry as a refused one is. A message and a wait
        fewer on every request than :meth:`commit`."""
        try:
            await bus.publish(
                self.nc,
                subjects.store_ctl(node, "tx.commit"),
                TxCommit(tx_id=tx_id, request_id=request_id),
            )
        except Exception as e:  # noqa: BLE001 - as unanswered: the lease settles it
            log.warning("store_commit_unsent", node=node, tx_id=tx_id, error=repr(e))

    async def abort(self, node: str, tx_id: str, request_id: str, reason: str) -> bool:
        msg = TxAbort(tx_id=tx_id, request_id=request_id, reason=reason)
        return isinstance(await self._request(node, "tx.abort", msg, TxDoneReply), TxDone)

    async def abort_many(self, txs: list[tuple[str, str]], request_id: str, reason: str) -> None:
        """Abort (node, tx_id) pairs in parallel."""
        await asyncio.gather(*(self.abort(node, tx, request_id, reason) for node, tx in txs))

    async def abort_all(self, request_id: str, alloc: AllocationRound, reason: str) -> None:
        await self.abort_many(
            [(node, h.tx_id) for node, h in alloc.handles.values()], request_id, reason
        )

    async def renew(self, node: str, tx_ids: list[str], lease_s: float) -> TxRenewed | None:
        """None when the store did not answer (the leases stand as they were)."""
        rep = await self._request(
            node, "tx.renew", TxRenew(tx_ids=tx_ids, lease_s=lease_s), TxRenewed
        )
        return rep if isinstance(rep, TxRenewed) else None

    async def _request(self, node: str, ep: str, msg: Any, reply_type: Any) -> Any:
        """The store's reply (one of ``reply_type``), or :class:`Unanswered`."""
        try:
            return await bus.request(
                self.nc, subjects.store_ctl(node, ep), msg, reply_type, timeout=self.timeout_s
            )
        except Exception as e:  # noqa: BLE001 - timeouts, no responders, bad replies
            log.warning(
                "store_request_failed", node=node, endpoint=ep, error=f"{type(e).__name__}: {e}"
            )
            return Unanswered(f"{node} {ep}: {type(e).__name__}")


class LeaseKeeper:
    """Renews the leases of the transactions a worker holds, one TxRenew per node every
    ``lease_s / 3``. ``expires_at`` tells how long the slots are certainly ours; a
    transaction the store no longer knows is reported ``lost``."""

    def __init__(self, tx: StoreTx, lease_s: float) -> None:
        self.tx = tx
        self.lease_s = lease_s
        self._held: dict[tuple[str, str], str] = {}  # (node, tx_id) -> request id
        self._expires: dict[tuple[str, str], float] = {}
        self.lost: set[tuple[str, str]] = set()
        self._losing: dict[tuple[str, str], asyncio.Event] = {}  # keys guarded now
        self._task: asyncio.Task[None] | None = None

    def hold(self, request_id: str, node: str, handle: TxHandle) -> None:
        key = (node, handle.tx_id)
        self._held[key] = request_id
        self._expires[key] = handle.expires_at or time.time() + self.lease_s
        self._ensure_running()

    def drop(self, node: str, tx_id: str) -> None:
        self._held.pop((node, tx_id), None)
        self._expires.pop((node, tx_id), None)
        self.lost.discard((node, tx_id))

    def expires_at(self, node: str, tx_id: str) -> float:
        """Unix seconds until which the store keeps the slots (0: not held or lost)."""
        return self._expires.get((node, tx_id), 0.0)

    def stale(self, key: tuple[str, str], margin_s: float = LEASE_MARGIN_S) -> bool:
        """Whether the end known for ``key`` might come before this keeper's next renewal
        would push it on (with room for that renewal's round trip). A holder that took a
        handle another worker was granted renews it first only then: a fresh handle's
        end is a lower bound (renewals only extend it), so asking the store again would
        be a round trip on the request's path that tells nothing new."""
        left = self._expires.get(key, 0.0) - time.time() - margin_s
        return left <= self.lease_s / 2

    @property
    def held(self) -> int:
        return len(self._held)

    async def renew_now(self, only: tuple[str, str] | None = None) -> None:
        """Renew every held lease now (or just ``only``, a (node, tx_id) held here)."""
        keys = list(self._held) if only is None else [only] if only in self._held else []
        by_node: dict[str, list[str]] = defaultdict(list)
        for node, tx_id in keys:
            by_node[node].append(tx_id)
        replies = await asyncio.gather(
            *(self.tx.renew(node, ids, self.lease_s) for node, ids in by_node.items())
        )
        for (node, _), rep in zip(by_node.items(), replies, strict=True):
            if rep is None:
                continue  # unreachable this round: the old leases stand, try again
            for t in rep.renewed:
                if (node, t) in self._held:
                    self._expires[(node, t)] = rep.expires_at
            for t in rep.unknown:
                if (node, t) in self._held:
                    log.warning("lease_lost", node=node, tx_id=t, request_id=self._held[(node, t)])
                    self.lost.add((node, t))
                    self._expires[(node, t)] = 0.0
                    if (node, t) in self._losing:
                        self._losing[(node, t)].set()

    async def before_expiry(
        self,
        key: tuple[str, str],
        work: Awaitable[T],
        *,
        renew_first: bool = False,
        margin_s: float = LEASE_MARGIN_S,
    ) -> T:
        """``work`` (an engine writing or reading the slots of ``key``, a (node, tx_id)
        held here) while the store certainly keeps them. Should the lease come within
        ``margin_s`` of its end or be reported lost first, ``work`` is cancelled and
        :class:`LeaseExpired` raised: past that point the slots may hold another
        request's blocks. ``renew_first``: the handle may be old, renew before judging."""
        fut = asyncio.ensure_future(work)
        losing = self._losing[key] = asyncio.Event()
        lost = asyncio.ensure_future(losing.wait())
        try:
            if renew_first:
                await self.renew_now(only=key)
            while True:
                # The lease is judged before the result: work done on slots the store
                # was about to hand on is not trusted.
                left = self.expires_at(*key) - time.time() - margin_s
                if left <= 0 or losing.is_set():
                    break
                if fut.done():
                    return fut.result()
                await asyncio.wait(
                    {fut, lost},
                    timeout=min(left, self.lease_s / 3),
                    return_when=asyncio.FIRST_COMPLETED,
                )
        except BaseException:
            fut.cancel()
            raise
        finally:
            lost.cancel()
            self._losing.pop(key, None)
        # Give the work the margin to stop (an engine aborts the request and stops
        # touching the slots) before the holder lets the transaction go.
        fut.cancel()
        await asyncio.wait({fut}, timeout=margin_s)
        raise LeaseExpired(f"the store no longer holds the slots of transaction {key[1]}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="lease-keeper")

    async def _run(self) -> None:
        while self._held:
            await asyncio.sleep(self.lease_s / 3)
            try:
                await self.renew_now()
            except Exception:  # noqa: BLE001 - a bug here must not stop the renewals
                log.exception("lease_renew_error")
