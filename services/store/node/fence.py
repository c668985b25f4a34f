"""Which arena slots a transfer may touch, and when a freed slot may be reused.

The store's pool runs on the event loop; KV bytes land from other threads (the TCP
receiver's stream threads, the transfer engine's senders) and, over shared memory or
RDMA, from other processes. :class:`SlotFence` is the one place both sides meet,
under one lock. It is the pool's free list (``append`` / ``popleft`` / ``len``), so
every slot the pool frees passes through it, and it keeps per slot:

    gen   bumped each time the slot is freed. A grant or an op remembers the gens it
          saw; if one moved by the time it ends, its bytes are *fenced*: discarded,
          reported failed, never read (the slot belonged to nobody by then).
    live  grants of the current gen that still allow new ops (write / read apart);
          freeing the slot revokes them, so a write that starts after an abort is
          refused before a byte lands.
    busy  open grants plus ops in progress, of any gen. A freed slot that is busy is
          *parked*: it is not handed out again until busy drops to zero, so a late
          write can never land in a slot that a new transaction already owns.

Lifecycle of a slot::

    available --popleft (allocated)--> in use --append (freed: gen+1, revoked)-->
        busy == 0: available
        busy > 0:  parked --last grant/op on it ends--> available

A *grant* (:meth:`open` / :meth:`close`) is the coordination-level permission: "the
peer may move bytes of these slots now"; the data plane opens it when a peer asks
over ZeroMQ and closes it on the peer's done/failed (or when it expires). An *op*
(:meth:`enter` / :meth:`leave`) is one physical transfer on a receiver thread: it
may start only under a live grant and holds the slots while bytes move.

A grant is also a *capability*: the data plane registers the unguessable token it drew
for it (:meth:`admit`), and a transport receiver (``ArenaGuard`` with
``capabilities``) lets an op start only when it presents the token of a grant that
covers every one of its slots in its direction, from the session (TCP sender
endpoint) that presented that token first. Another grant's slots, or slots that are
live under somebody else's grant, are refused.
"""

import itertools
import threading
from collections import deque
from collections.abc import Iterable, Iterator, MutableSequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SlotGrant:
    """A grant as it opened: its slots, their generations then, and its direction."""

    id: int
    slots: tuple[int, ...]
    gens: tuple[int, ...]
    write: bool


@dataclass
class _Capability:
    grant: SlotGrant
    slots: frozenset[int]
    session: bytes | None = None  # bound on first use


@dataclass(frozen=True)
class Op:
    """One transfer in progress: its slots and the generations it saw when it started."""

    slots: tuple[int, ...]
    gens: tuple[int, ...]


class SlotFence:
    """Which slots a transfer may touch, and when a freed slot may be handed out again."""

    def __init__(self, capacity: int, gens: MutableSequence[int] | None = None) -> None:
        """``gens``: where the generations live, zeros, ``capacity`` long (the data plane
        passes an int64 view of shared memory, so a same-host writer can check them
        after its copy without asking)."""
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self._lock = threading.Lock()
        self._available: deque[int] = deque(range(capacity))
        self._parked: set[int] = set()
        if gens is None:
            gens = [0] * capacity
        elif len(gens) != capacity or any(gens):
            raise ValueError(f"gens must be {capacity} zeros")
        self._gen = gens
        self._live_w = [0] * capacity
        self._live_r = [0] * capacity
        self._busy = [0] * capacity
        self._ids = itertools.count(1)
        self._caps: dict[bytes, _Capability] = {}
        self.counters = {
            "grants": 0,
            "fenced_grants": 0,
            "ops": 0,
            "fenced_ops": 0,
            "refused_ops": 0,
            "unauthorized_ops": 0,
            "parked": 0,
        }

    # ------------------------------------------------------------------ free list (pool)

    def __len__(self) -> int:
        return len(self._available)

    def __iter__(self) -> Iterator[int]:
        with self._lock:
            return iter([*self._available, *sorted(self._parked)])

    def popleft(self) -> int:
        with self._lock:
            return self._available.popleft()

    def append(self, slot: int) -> None:
        """The pool freed ``slot``: fence whatever is open on it."""
        with self._lock:
            self._gen[slot] += 1
            self._live_w[slot] = self._live_r[slot] = 0
            if self._busy[slot]:
                self._parked.add(slot)
                self.counters["parked"] += 1
            else:
                self._available.append(slot)

    @property
    def parked(self) -> int:
        return len(self._parked)

    def generation(self, slot: int) -> int:
        return self._gen[slot]

    def unshare_gens(self) -> None:
        """Keep the generations in a list of our own from now on (before the shared
        memory that held them is released)."""
        with self._lock:
            self._gen = list(self._gen)

    # ------------------------------------------------------------------ grants

    def open(self, slots: Iterable[int], write: bool) -> SlotGrant:
        """Allow ops on ``slots`` (the caller checked they belong to a live transaction)."""
        s = tuple(slots)
        live = self._live_w if write else self._live_r
        with self._lock:
            for i in s:
                live[i] += 1
                self._busy[i] += 1
            self.counters["grants"] += 1
            return SlotGrant(next(self._ids), s, tuple(self._gen[i] for i in s), write)

    def close(self, g: SlotGrant) -> bool:
        """End ``g``; False when any of its slots was freed meanwhile (fenced)."""
        live = self._live_w if g.write else self._live_r
        ok = True
        with self._lock:
            for i, gen in zip(g.slots, g.gens, strict=True):
                if self._gen[i] == gen:
                    live[i] -= 1
                else:
                    ok = False
                self._unbusy(i)
            if not ok:
                self.counters["fenced_grants"] += 1
        return ok

    def admit(self, token: bytes, g: SlotGrant) -> None:
        """Ops presenting ``token`` may move bytes of ``g``'s slots (until :meth:`revoke`)."""
        with self._lock:
            self._caps[token] = _Capability(g, frozenset(g.slots))

    def revoke(self, token: bytes) -> None:
        with self._lock:
            self._caps.pop(token, None)

    @property
    def capabilities(self) -> int:
        return len(self._caps)

    def authorize(self, token: bytes, session: bytes, slots: range, write: bool) -> bool:
        """Whether ``token`` is a live grant's, in ``write``'s direction, covering every
        slot of ``slots``, and ``session`` is the one that presented it first (bound now
        when none did)."""
        with self._lock:
            cap = self._caps.get(token)
            ok = (
                cap is not None
                and cap.grant.write == write
                and all(i in cap.slots for i in slots)
                and (cap.session is None or cap.session == session)
            )
            if ok:
                assert cap is not None
                if cap.session is None:
                    cap.session = session
            else:
                self.counters["unauthorized_ops"] += 1
            return ok

    def writing(self, slots: Iterable[int]) -> bool:
        """Whether a grant or op is open on any of ``slots``."""
        with self._lock:
            return any(self._busy[i] for i in slots)

    # ------------------------------------------------------------------ ops (any thread)

    def enter(self, slots: Iterable[int], write: bool) -> Op | None:
        """Start moving bytes of ``slots``; None (refused) unless each is under a live grant."""
        s = tuple(slots)
        live = self._live_w if write else self._live_r
        with self._lock:
            if not s or any(not 0 <= i < self.capacity or live[i] <= 0 for i in s):
                self.counters["refused_ops"] += 1
                return None
            for i in s:
                self._busy[i] += 1
            self.counters["ops"] += 1
            return Op(s, tuple(self._gen[i] for i in s))

    def leave(self, op: Op) -> bool:
        """The bytes of ``op`` moved; False when a slot was freed meanwhile (fenced)."""
        with self._lock:
            ok = all(self._gen[i] == g for i, g in zip(op.slots, op.gens, strict=True))
            for i in op.slots:
                self._unbusy(i)
            if not ok:
                self.counters["fenced_ops"] += 1
        return ok

    def _unbusy(self, i: int) -> None:
        self._busy[i] -= 1
        if self._busy[i] == 0 and i in self._parked:
            self._parked.discard(i)
            self._available.append(i)


class ArenaGuard:
    """The fence seen by a transport receiver: byte ranges of the arena region -> slots."""

    def __init__(self, fence: SlotFence, block_bytes: int, capabilities: bool = False) -> None:
        """``capabilities``: an op must present its grant's token (the data plane's
        guard); without, any live grant lets it in (a receiver in a test)."""
        self.fence = fence
        self.block_bytes = block_bytes
        self.capabilities = capabilities
        self.region: int | None = None  # the arena's region id; other regions pass

    def enter(
        self,
        region: int,
        offset: int,
        length: int,
        write: bool,
        token: bytes = b"",
        session: bytes = b"",
    ) -> tuple[Op | None, str | None]:
        if region != self.region:
            return None, None if not self.capabilities else "no such region"
        if length <= 0:
            return None, None
        bb = self.block_bytes
        slots = range(offset // bb, (offset + length - 1) // bb + 1)
        if self.capabilities and not self.fence.authorize(token, session, slots, write):
            return None, "not authorized"
        op = self.fence.enter(slots, write)
        if op is None:
            return None, (
                f"bytes {offset}+{length} are not in slots granted for "
                f"{'writing' if write else 'reading'} (aborted or expired?)"
            )
        return op, None

    def leave(self, op: Op) -> str | None:
        if self.fence.leave(op):
            return None
        return f"slots {list(op.slots[:8])} were freed while their bytes moved: fenced"
