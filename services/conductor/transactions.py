"""The conductor's side of the stores' transactions (paper §5.3, Fig. 9).

One placement opens up to three transactions, all in parallel: PREFILL on the prefill
node (lock the cached prefix, allocate the rest), DECODE on the decode node (a slot for
every block), SOURCE on the holder of a remote prefix (lock only). A placement either
gets every handle or rolls back the ones it got (:meth:`StoreTx.abort_all`). After the
first token the prefill and SOURCE transactions are committed; on failure aborted.
Store requests never raise here: a timeout or missing store is an error string.
"""

import asyncio
from dataclasses import dataclass, field
from typing import Any

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
    TxReply,
    TxRole,
)
from bus_schemas.requests import GenerateRequest
from services.common import bus
from services.conductor.policy import Placement

log = structlog.get_logger()


@dataclass
class Allocation:
    """Outcome of one round of TxAllocate, by role ("prefill", "decode", "source")."""

    handles: dict[str, tuple[str, TxHandle]] = field(default_factory=dict)  # role -> (node, handle)
    refused: dict[str, str] = field(default_factory=dict)  # role -> Refused.reason
    failed: dict[str, str] = field(default_factory=dict)  # role -> error (timeout, no store)

    @property
    def ok(self) -> bool:
        return not self.refused and not self.failed

    def broke(self, role: str) -> bool:
        return role in self.refused or role in self.failed


class StoreTx:
    def __init__(
        self, nc: NATS, *, block_size: int, lease_s: float, timeout_s: float = 2.0
    ) -> None:
        self.nc = nc
        self.block_size = block_size
        self.lease_s = lease_s
        self.timeout_s = timeout_s

    async def allocate(self, req: GenerateRequest, p: Placement) -> Allocation:
        hashes = req.block_hashes or []
        n = len(req.prompt_token_ids)
        common: dict[str, Any] = dict(
            request_id=req.request_id,
            retention=req.retention,
            context_ttl_s=req.context_ttl_s,
            lease_s=self.lease_s,
        )
        jobs = {
            "prefill": (
                p.prefill_node,
                TxAllocate(role=TxRole.PREFILL, block_hashes=hashes, num_tokens=n, **common),
            ),
            "decode": (
                p.decode_node,
                TxAllocate(role=TxRole.DECODE, block_hashes=hashes, num_tokens=n, **common),
            ),
        }
        if p.remote is not None:
            # Lock the holder's whole prefix, so the pull can start wherever the prefill
            # node's own hit (known only from its reply) ends.
            end = p.remote.first_block + p.remote.num_blocks
            src = TxAllocate(
                role=TxRole.SOURCE,
                block_hashes=hashes[:end],
                num_tokens=end * self.block_size,
                **common,
            )
            jobs["source"] = (p.remote.node, src)
        replies = await asyncio.gather(
            *(self._request(node, "tx.allocate", msg, TxReply) for node, msg in jobs.values())
        )
        out = Allocation()
        for (role, (node, _)), rep in zip(jobs.items(), replies, strict=True):
            if isinstance(rep, TxHandle):
                out.handles[role] = (node, rep)
            elif isinstance(rep, Refused):
                out.refused[role] = rep.reason
            else:
                out.failed[role] = str(rep)
        return out

    async def commit(self, node: str, tx_id: str, request_id: str) -> bool:
        rep = await self._request(
            node, "tx.commit", TxCommit(tx_id=tx_id, request_id=request_id), TxDoneReply
        )
        if not isinstance(rep, TxDone):
            log.warning("commit_failed", node=node, tx_id=tx_id, reply=str(rep))
            return False
        return True

    async def abort(self, node: str, tx_id: str, request_id: str, reason: str) -> bool:
        msg = TxAbort(tx_id=tx_id, request_id=request_id, reason=reason)
        return isinstance(await self._request(node, "tx.abort", msg, TxDoneReply), TxDone)

    async def abort_many(self, txs: list[tuple[str, str]], request_id: str, reason: str) -> None:
        """Abort (node, tx_id) pairs in parallel."""
        await asyncio.gather(*(self.abort(node, tx, request_id, reason) for node, tx in txs))

    async def abort_all(self, request_id: str, alloc: Allocation, reason: str) -> None:
        await self.abort_many(
            [(node, h.tx_id) for node, h in alloc.handles.values()], request_id, reason
        )

    async def _request(self, node: str, ep: str, msg: Any, reply_type: Any) -> Any:
        try:
            return await bus.request(
                self.nc, subjects.store_ctl(node, ep), msg, reply_type, timeout=self.timeout_s
            )
        except Exception as e:  # noqa: BLE001 - timeouts, no responders, bad replies
            log.warning(
                "store_request_failed", node=node, endpoint=ep, error=f"{type(e).__name__}: {e}"
            )
            return f"{node} {ep}: {type(e).__name__}"
