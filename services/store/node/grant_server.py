"""The data plane's serving side: grants on this store's slots for peers' OPEN and CLOSE.

      OPEN  (from a peer store): checked against the pool (slots of a live transaction
            of this epoch; writes only into slots the transaction allocated); a grant is
            opened on the slots in the :class:`~services.store.node.fence.SlotFence` and
            GRANTED names this store's transfer segments. Answered at once.
      CLOSE (from a peer store): the grant ends: OK when its slots stayed live, else
            ERR ``fenced`` (the transaction was aborted or expired meanwhile: the bytes
            are discarded, the slots are reused only now that nothing moves into them).
    grant sweep: a served grant past its ttl is closed as failed; a same-host writer's
            (it copies into our memory itself) gets one more ttl, never more: nothing
            a requester says of its own process (a pid) keeps a grant open.

A grant is a capability: GRANTED carries a random token, its CLOSE and every TCP
transfer under it must present it. :class:`GrantServer` is one side of
:class:`~services.store.node.data_plane.DataPlane`, which owns the state both sides
read (the pool checks, the fence, the counters) and routes the frames.
"""

import asyncio
import hmac
import secrets
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from services.store.node.fence import SlotFence, SlotGrant
from services.store.node.shared_gens import OwnGens
from services.transfer import wire

log = structlog.get_logger()


@dataclass
class _Served:
    """A grant this store gave a peer."""

    grant: SlotGrant
    tx: str
    nbytes: int
    deadline: float
    same_host: bool
    token: bytes
    grace: float = 0.0  # a same-host writer's grant is closed at deadline + grace


class GrantServer:
    """The serving side of the data plane: grants peers hold on this store's slots."""

    # Set up by the DataPlane this is part of.
    fence: SlotFence
    own_gens: OwnGens | None
    counters: dict[str, int]
    segments: dict[str, str]
    regions: dict[str, int]
    peer_timeout_s: float
    clock: Callable[[], float]
    _check: Callable[[str, int, list[int], bool, int], None]
    _spans: Callable[[list[int], int, int, int], list[memoryview]]
    _deadline: Callable[[int], float]
    _reachable: Callable[[str, str], bool]

    def _init_grants(self) -> None:
        self._served: dict[int, _Served] = {}
        self._by_tx: dict[str, set[int]] = {}
        self._settle: dict[str, asyncio.Event] = {}

    def serve_open(self, h: wire.Open) -> wire.Granted:
        """A peer asks to move bytes of our slots: grant it if they are live."""
        if len(set(h.slots)) != len(h.slots):
            raise wire.WireError("slots repeat", code="bad_request", req_id=h.id)
        self._check(h.tx, h.epoch, h.slots, h.write, h.id)
        self._spans(h.slots, h.offset, h.length, h.id)
        g = self.fence.open(h.slots, h.write)
        nbytes = len(h.slots) * h.length
        ttl = self._deadline(nbytes) + self.peer_timeout_s
        token = secrets.token_bytes(16)
        same_host = h.write and bool(h.origin) and self._reachable("shm", h.origin)
        self._served[g.id] = _Served(
            g, h.tx, nbytes, self.clock() + ttl, same_host, token, ttl if same_host else 0.0
        )
        self.fence.admit(token, g)
        self._by_tx.setdefault(h.tx, set()).add(g.id)
        self.counters["grants_served"] += 1
        shared = h.write and self.own_gens is not None
        return wire.Granted(
            id=h.id,
            grant=g.id,
            segments=self.segments,
            regions=self.regions,
            ttl_s=ttl,
            gens=list(g.gens) if shared else [],
            gens_shm=self.own_gens.name if shared and self.own_gens is not None else "",
            token=token,
        )

    def serve_close(self, h: wire.Close) -> wire.Ok:
        s = self._served.get(h.grant)
        if s is not None and not hmac.compare_digest(s.token, h.token):
            s = None  # not its holder: answered as an unknown grant
        if s is not None:
            self._end(h.grant)
        if s is None:
            raise wire.WireError(
                f"no open grant {h.grant} (it expired)", code="fenced", req_id=h.id
            )
        if not self.fence.close(s.grant):
            self.counters["grants_fenced"] += 1
            raise wire.WireError(
                f"transaction {s.tx} lost slots while bytes moved (aborted or "
                "expired): fenced, discarded",
                code="fenced",
                req_id=h.id,
            )
        # A lease's CLOSE says how many bytes its ships moved (several spans, or none).
        nbytes = h.nbytes if h.ok else 0
        if h.ok:
            n = len(s.grant.slots)
            if s.grant.write:
                self.counters["writes_in"] += 1
                self.counters["blocks_written_remote"] += n
                self.counters["bytes_in"] += nbytes
            else:
                self.counters["reads_in"] += 1
                self.counters["blocks_read_remote"] += n
                self.counters["bytes_out"] += nbytes
        return wire.Ok(id=h.id, nbytes=nbytes)

    def open_grants(self, tx: str) -> int:
        """Grants peers hold on ``tx``'s slots."""
        return len(self._by_tx.get(tx, ()))

    async def settled(self, tx: str, timeout: float) -> bool:
        """Wait until no peer holds a grant on ``tx``'s slots (a commit waits for this:
        bytes must not land in a block once it is cached); False after ``timeout``."""
        if tx not in self._by_tx:
            return True
        ev = self._settle.setdefault(tx, asyncio.Event())
        try:
            async with asyncio.timeout(timeout):
                await ev.wait()
        except TimeoutError:
            return tx not in self._by_tx
        return True

    def expire_grants(self, now: float | None = None) -> list[int]:
        """Close (as failed) every served grant past its ttl; returns their ids."""
        now = self.clock() if now is None else now
        out = []
        for gid, s in list(self._served.items()):
            if s.deadline + s.grace > now:
                continue  # (a same-host writer copies into our memory itself: one more ttl)
            self._end(gid)
            self.fence.close(s.grant)
            self.counters["grants_expired"] += 1
            log.warning("grant_expired", grant=gid, tx=s.tx, write=s.grant.write)
            out.append(gid)
        return out

    def _end(self, gid: int) -> _Served | None:
        s = self._served.pop(gid, None)
        if s is not None:
            self.fence.revoke(s.token)
            ids = self._by_tx.get(s.tx)
            if ids is not None:
                ids.discard(gid)
                if not ids:
                    del self._by_tx[s.tx]
                    ev = self._settle.pop(s.tx, None)
                    if ev is not None:
                        ev.set()
        return s
