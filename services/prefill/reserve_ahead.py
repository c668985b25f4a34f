"""The first round of a request's reservation when its conductor sent it.

A conductor that places a request on an idle prefill instance sends the request's
TxAllocates itself, right after the task (``PrefillTask.reserved_ahead`` is their key),
the stores answering on ``subjects.prefill_reserved(instance, key, role)``: the store
round trip then overlaps the task's way here instead of following it (0.5-0.8 ms off
the first token through the mock stack on 2 cores, BENCHMARKS.md). The task goes first:
on a machine with fewer cores than woken processes the instance is then not the last
to run. The rounds after the first, and any reservation of a task not sent ahead, are
the worker's own (services.prefill.reserve).

One key's life here (:class:`AheadReplies`)::

    arriving  each store's answer, as soon as it is made (often before the task): a
              granted transaction is held from then on (its lease renewed)
    taken     the worker's reservation takes the answers as its compute starts
              (:meth:`take`), waiting at most ``wait_s`` for those not in yet; a role
              still missing then is allocated again by the worker, and its late answer
              aborted
    dropped   the task ended before its reservation (refused, cancelled, shut down:
              :meth:`drop`), or never came within ``forget_s``: what arrived, and what
              arrives later, is aborted

A reply that is no answer (an error reply, a payload that does not decode) counts as
that role's failure, as the worker's own round would count it. A node with no store
sends nothing here (the server's no-responders goes to the sender, the conductor): the
role is missing ``straggler_s`` after the round's other answers (``wait_s`` if none came),
and the worker's own request learns why.
"""

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
from nats.aio.msg import Msg as NatsMsg

from bus_schemas.codec import BadMessage, decode
from bus_schemas.control import Refused, TxHandle, TxReply
from services.common.bus import ERROR_HEADER
from services.common.store_tx import AllocationRound, LeaseKeeper, StoreTx

log = structlog.get_logger()

WAIT_S = 2.0  # the worker's own store requests time out after as long
# Once one store answered, the others of the same round (sent together) are waited for
# this much longer at most: a store that died since the conductor last heard of it
# answers nothing (its no-responders goes to the conductor), and the worker's own
# request then learns so at once instead of after WAIT_S. A store alive but slower
# than this is asked again, its late answer aborted.
STRAGGLER_S = 0.2
FORGET_S = 30.0  # a key no task took by then is dropped (its task was lost)
REMEMBER_DROPPED = 4096  # keys whose late answers are aborted on arrival


@dataclass
class _Key:
    request_id: str = ""
    got: dict[str, Any] = field(default_factory=dict)  # role -> TxHandle | Refused | str
    came: asyncio.Event = field(default_factory=asyncio.Event)
    since: float = 0.0
    first: float | None = None  # when the first answer came


class AheadReplies:
    """The stores' answers to the TxAllocates conductors sent for this instance."""

    def __init__(
        self,
        tx: StoreTx,
        *,
        lease_s: float,
        wait_s: float = WAIT_S,
        straggler_s: float = STRAGGLER_S,
        forget_s: float = FORGET_S,
        clock: Callable[[], float] = time.monotonic,
        counters: dict[str, int] | None = None,
    ) -> None:
        self.tx = tx
        self.leases = LeaseKeeper(tx, lease_s)
        self.wait_s = wait_s
        self.straggler_s = straggler_s
        self.forget_s = forget_s
        self.clock = clock
        self._keys: dict[str, _Key] = {}
        self._done: OrderedDict[str, None] = OrderedDict()  # taken or dropped
        self._tasks: set[asyncio.Task[Any]] = set()
        self._sweeper: asyncio.Task[None] | None = None
        self.counters = {} if counters is None else counters
        for name in ("ahead_taken", "ahead_missing", "ahead_aborted"):
            self.counters.setdefault(name, 0)

    # -- the subscription --
    async def on_reply(self, m: NatsMsg) -> None:
        """An answer on ``perigee.prefill.<instance>.reserved.<key>.<role>``."""
        parts = m.subject.split(".")
        if len(parts) != 6:
            return
        key, role = parts[4], parts[5]
        rep = _answer(m)
        if key in self._done:  # taken without it, or dropped: nobody will use it
            self._abort(rep, "reserved ahead, not taken")
            return
        k = self._keys.setdefault(key, _Key(since=self.clock()))
        if role in k.got:
            self._abort(rep, "reserved ahead twice")
            return
        k.got[role] = rep
        if k.first is None:
            k.first = self.clock()
        if isinstance(rep, TxHandle):
            self.leases.hold(k.request_id or key, rep.node, rep)
        k.came.set()
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(
                self._sweep_while_held(), name="reserve-ahead-sweep"
            )

    # -- the worker --
    async def take(self, key: str, request_id: str, roles: set[str]) -> AllocationRound:
        """The answers for ``roles``, as one round; a role not answered within
        ``wait_s``, or ``straggler_s`` after the round's first answer, is left out (the
        worker allocates it), its late answer aborted."""
        k = self._keys.setdefault(key, _Key(since=self.clock()))
        k.request_id = request_id
        deadline = self.clock() + self.wait_s
        while not roles <= set(k.got):
            end = deadline if k.first is None else min(deadline, k.first + self.straggler_s)
            if (left := end - self.clock()) <= 0:
                break
            k.came.clear()
            try:
                await asyncio.wait_for(k.came.wait(), left)
            except TimeoutError:
                break
        self._forget(key)
        out = AllocationRound()
        for role in roles:
            rep = k.got.get(role)
            if isinstance(rep, TxHandle):
                self.leases.drop(rep.node, rep.tx_id)  # the reservation holds it now
                out.handles[role] = (rep.node, rep)
            elif isinstance(rep, Refused):
                out.refused[role] = rep.reason
            elif isinstance(rep, str):
                out.failed[role] = rep
            else:
                self.counters["ahead_missing"] += 1
        for role in set(k.got) - roles:
            self._abort(k.got[role], "reserved ahead, not wanted", request_id)
        self.counters["ahead_taken"] += 1
        return out

    def answers(self, key: str) -> int:
        """How many answers for ``key`` are here, not taken yet."""
        k = self._keys.get(key)
        return len(k.got) if k is not None else 0

    def drop(self, key: str, reason: str) -> None:
        """The task of ``key`` ends without its reservation: abort what it holds."""
        k = self._keys.get(key)
        self._forget(key)
        if k is not None:
            for rep in k.got.values():
                self._abort(rep, reason, k.request_id)

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        for key in list(self._keys):
            self.drop(key, "prefill instance shutting down")
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=2)
        await self.leases.close()

    # -- helpers --
    def _forget(self, key: str) -> None:
        self._keys.pop(key, None)
        self._done[key] = None
        while len(self._done) > REMEMBER_DROPPED:
            self._done.popitem(last=False)

    def sweep(self) -> None:
        """Drop the keys no task took within ``forget_s`` (their task was lost)."""
        horizon = self.clock() - self.forget_s
        for key in [k for k, v in self._keys.items() if v.since < horizon]:
            log.warning("reserved_ahead_never_taken", key=key)
            self.drop(key, "reserved ahead, task never came")

    async def _sweep_while_held(self) -> None:
        # Runs while answers wait: without it a lost task's transactions would be
        # renewed for ever.
        while self._keys:
            await asyncio.sleep(self.forget_s / 4)
            self.sweep()

    def _abort(self, rep: Any, reason: str, request_id: str = "") -> None:
        if not isinstance(rep, TxHandle):
            return
        self.leases.drop(rep.node, rep.tx_id)
        self.counters["ahead_aborted"] += 1
        t = asyncio.get_running_loop().create_task(
            self.tx.abort(rep.node, rep.tx_id, request_id, reason),
            name=f"ahead-abort:{rep.tx_id}",
        )
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)


def _answer(m: NatsMsg) -> TxHandle | Refused | str:
    """A store's answer to a TxAllocate, or why it is none (a string)."""
    if m.headers and m.headers.get("Status") == "503":
        return "no store listening"
    if m.headers and ERROR_HEADER in m.headers:
        return f"error reply: {m.headers.get(ERROR_HEADER)}"
    try:
        rep: TxHandle | Refused = decode(m.data, TxReply)
    except BadMessage as e:
        return f"bad reply: {e}"
    return rep
