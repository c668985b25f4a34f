"""KVCache-centric placement: paper Algorithm 1 (§4.1) with cache load balancing (§4.2).

Pure: an injected :class:`Clock` and :class:`CostModel`, no I/O. The conductor
service and the simulator drive the same :class:`PlacementPolicy`.

Times are per instance: ``cost(i)`` is instance i's own fitted model from the
:class:`~services.common.calibration.CalibrationBook` (fed from the fits the load
reports carry), the prior ``cost`` until i reported one or when the book is fixed
(a hand-given ``--cost-model``). Transfer times and KV sizes stay ``cost``'s.

Per request and per live prefill instance ``i`` (on node ``node(i)``)::

    own    = prefix match of node(i) in blocks          (shadow index)
    best   = longest match on any node, held by ``src``
    if best / own > balancing_threshold (own == 0: ratio inf) and best > own:
        prefix = best;  T_transfer = cost.transfer_time((best - own) * B, bytes in flight from src)
    else:
        prefix = own;   T_transfer = 0
    T_queue   = queued_work_s of i's latest PrefillLoad + work this policy dispatched to i
                that no report has covered yet
    T_prefill = cost(i).prefill_time(n, min(prefix * B, n - 1))   (the last token is always computed)
    TTFT(i)   = T_transfer + T_queue + T_prefill          -> choose argmin

Decode: argmin over live decode instances of
``cost(d).decode_tbt(batch + waiting + dispatched + s, kv_tokens + dispatched_tokens + s * n, max_batch)``
(past ``max_batch`` the sequences take turns, so a backlog counts as load), where a
request with ``s`` sequences (OpenAI's n choices, ``PlacementRequest.seqs``) joins as s
sequences of its prompt's n tokens and ``dispatched`` counts the sequences placed
there; its TTFT is one prefill's. The decode engine holds the prompt's KV once, in
pages its s sequences share, but each step's attention reads it once per sequence, and
the step time prices what a step reads: s x n (``CostModel.tbt_joining``).
Reject with 429 when TTFT > TTFT SLO or TBT > TBT SLO; 503 when no live instance of a
role. ``tbt_check=False`` skips the TBT rejection here (the paper's baseline, which
rejects at decode after the prefill: services.policy.decode_side_check.DecodeSideCheck).

Hot-spot migration (§4.2, Algorithm 1 lines 20-21): a placement with ``remote`` set
makes the chosen instance pull blocks [first_block, first_block + num_blocks) from the
holder into *new* slots of its PREFILL transaction. Those slots are committed with the
rest of the request's blocks after the first token, so the prefill node becomes a
replica: its store announces the blocks (BlockStored) and the shadow index then
matches the prefix on both nodes. Nothing else is needed to replicate a hot prefix;
``stats["pulls"]`` and ``stats["pulled_blocks"]`` count the migrations started.

Threshold: fixed (``balancing_threshold``) or tuned online by an
:class:`~services.conductor.balancing.AdaptiveThreshold` (``adaptive``), which this
policy feeds: every placement is recorded with its predicted TTFT, and
:meth:`prefill_done` reports the observed one (placement -> first token).

Chunked pipeline parallelism (§3.3, ``cpp``): with ``cpp.group_size`` X > 1 every X
live prefill instances form a group (:mod:`services.policy.chunk_timing`), and for the
cache-aware strategies each group is one more candidate: its anchor's own prefix, the
members' queues and the pipeline timing; the argmin takes it only when strictly
faster, so a one-chunk request stays on one instance. The dispatch records each
member's work until its stage is done. A short request (``cpp.interleave_tokens``)
runs on a member between two of the pipeline's chunks, so it sees only the member's
report; a longer one also waits for the member's stages still to run, and on a tie a
short one goes to an instance that is no stage.

Strategies (paper Fig. 5 baselines): ``global`` (above), ``local`` (cache-aware, never
transfers), ``load`` (least queued work), ``random``.

Search (issue 27): no strategy evaluates every instance. The prefix holders come from
the index's match, the rest from ordered load structures
(:mod:`services.conductor.search`, kept by the observe/dispatch hooks in O(log n)),
walked only until a lower bound shows nobody further can win; CPP groups likewise,
ordered by their busiest member; ``random`` draws from a view of the load book's
ordered names. The choice is the full scan's (``pruned = False`` runs the scan, the
reference the tests hold it to); the search module lists what still costs per
instance.

Dispatch accounting (so back-to-back placements spread before the next report):
``place`` records the request's work on its prefill instance, its tokens on its decode
instance and its transfer bytes on the source node. The prefill part is dropped by a
PrefillLoad whose ``ts`` is at least ``report_grace_s`` after the placement (the report
includes it; 0 in a simulator, tens of ms on a real bus) or by
:meth:`prefill_done`; the decode part by a DecodeLoad at or after the handoff to
decode (:meth:`prefill_done`'s ``handoff_ts``); everything by :meth:`release`. The clock and report
``ts`` must share a time base (unix seconds in the service, sim time in the simulator).

Why ``balancing_threshold = 2.0``: in the cost model a pulled token costs
kv_bytes/B_nic (~3 us for LLaMA3-70B on A800) against ~50 us to recompute it, so a
pure-cost rule would always pull. What the model does not see is the fixed overhead of
a SOURCE transaction plus pull round trip, congestion on the holder's NIC beyond what
this conductor dispatched, and the memory of a second copy. Requiring the remote prefix
to be at least twice the local one pulls only when it replaces most of the compute,
which still replicates hot prefixes to new nodes (own = 0 gives ratio inf).
"""

import math
import random
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from bus_schemas.load import DecodeLoad, PrefillLoad
from bus_schemas.placement import PrefixSource
from bus_schemas.requests import ErrorCode, GenerateRequest
from bus_schemas.roles import Role
from services.common import defaults
from services.common.calibration import CalibrationBook
from services.common.clock import Clock
from services.common.cost_model import CostModel
from services.common.hashing import block_hashes
from services.common.incarnation import RESTARTED, STALE
from services.common.load_book import LoadBook
from services.common.rejection import Rejection
from services.common.slo_check import TbtCheck
from services.conductor import search
from services.conductor.balancing import AdaptiveThreshold
from services.conductor.feedback import TtftFeedback
from services.conductor.prefix_index import NodeGroup
from services.policy import chunk_timing as cpp_
from services.policy.retry_schedule import RetrySchedule

STRATEGIES = ("global", "local", "load", "random")
DEFAULT_BALANCING_THRESHOLD = 2.0


@dataclass(frozen=True)
class PlacementRequest:
    """What placement needs of a request: its length, block hashes and SLOs."""

    request_id: str
    num_tokens: int  # prompt length
    block_hashes: tuple[int, ...]  # chained hashes of the full blocks
    block_size: int
    ttft_slo_s: float | None = None  # None: the policy's default
    tbt_slo_s: float | None = None
    # When the request reached the gateway (the policy clock's time base; 0: unknown):
    # the TTFT SLO is the client's, so what the request already spent in the gateway,
    # admission and the bus counts against it.
    arrival_ts: float = 0.0
    # Sequences sampled from the prompt (OpenAI's n): one prefill, n decode sequences.
    seqs: int = 1

    @classmethod
    def from_request(cls, req: GenerateRequest, block_size: int) -> "PlacementRequest":
        # The hashes are used as they come, unchecked: admission checked them against the
        # prompt (AdmissionService.fill, where a gateway's or a bus client's request
        # enters), and only admission's login may publish on the conductors' subjects
        # (services.common.bus_permissions; the admin login is the operator's). They are
        # computed here only for another block size (or none), a conversion, not a check.
        if req.block_hashes is not None and req.block_size == block_size:
            hashes: Sequence[int] = req.block_hashes
        else:
            hashes = block_hashes(req.prompt_token_ids, block_size)
        return cls(
            request_id=req.request_id,
            num_tokens=len(req.prompt_token_ids),
            block_hashes=tuple(hashes),
            block_size=block_size,
            ttft_slo_s=req.ttft_slo_s,
            tbt_slo_s=req.tbt_slo_s,
            arrival_ts=req.arrival_ts,
            seqs=req.sampling.n,
        )


@dataclass(frozen=True)
class RemoteSource:
    """Blocks [first_block, first_block + num_blocks) to pull from ``node``."""

    node: str
    first_block: int
    num_blocks: int


@dataclass(frozen=True)
class Placement:
    """Where a request runs, what prefix it reuses, and the times the policy expects."""

    request_id: str
    prefill_instance: str
    prefill_node: str
    decode_instance: str
    decode_node: str
    prefix_blocks: int  # blocks whose KV the prefill instance will not compute (own + pulled)
    prefix_tokens: int  # prefix_blocks * block_size
    remote: RemoteSource | None
    est_ttft_s: float
    est_queue_s: float
    est_transfer_s: float
    est_prefill_s: float
    est_tbt_s: float
    strategy: str
    # Chunked pipeline parallelism (services.policy.chunk_timing): the stages in pipeline
    # order (``prefill_instance`` is the anchor, one of them), their nodes, the chunk size and when
    # each stage is done (seconds after placement, queues included). Empty: one instance.
    cpp_stages: tuple[str, ...] = ()
    cpp_stage_nodes: tuple[str, ...] = ()
    cpp_chunk_tokens: int = 0
    cpp_stage_end_s: tuple[float, ...] = ()

    @property
    def source(self) -> PrefixSource | None:
        """The remote prefix as the PrefillTask carries it (the instance locks it)."""
        r = self.remote
        return (
            PrefixSource(node=r.node, first_block=r.first_block, num_blocks=r.num_blocks)
            if r
            else None
        )

    @property
    def expected_hit_blocks(self) -> int:
        """Leading blocks the prefill node itself is expected to hold."""
        return self.remote.first_block if self.remote else self.prefix_blocks


Decision = Placement | Rejection


@dataclass
class _Dispatch:
    request_id: str
    prefill_instance: str
    decode_instance: str
    source_node: str | None
    transfer_bytes: float
    work_s: float
    tokens: int  # KV tokens a decode step reads there: the prompt once per sequence
    placed_at: float
    est_ttft_s: float = 0.0  # as placed, before the TTFT feedback's factor
    prefill_open: bool = True
    decode_since: float | None = None  # first-token time; None: not yet
    # A pipelined request's work per member (empty: all of work_s on prefill_instance).
    stage_work: dict[str, float] = field(default_factory=dict)
    # And when each member's stage is expected done (the policy clock's time).
    stage_end_at: dict[str, float] = field(default_factory=dict)
    seqs: int = 1  # decode sequences (OpenAI's n)

    def work_on(self, instance: str) -> float:
        return self.stage_work.get(instance, self.work_s) if self.stage_work else self.work_s

    def prefill_members(self) -> tuple[str, ...]:
        return tuple(self.stage_work) if self.stage_work else (self.prefill_instance,)


@dataclass
class _Candidate:
    instance: str
    node: str
    own_blocks: int
    prefix_blocks: int
    remote: RemoteSource | None
    queue_s: float
    transfer_s: float
    prefill_s: float
    factor: float = 1.0  # the instance's observed/predicted TTFT (TtftFeedback)
    stages: tuple[str, ...] = ()  # a CPP group, in pipeline order (empty: one instance)
    stage_nodes: tuple[str, ...] = ()
    stage_end_s: tuple[float, ...] = ()
    stage_work: tuple[float, ...] = ()  # what each member is held for (cpp.member_work)
    in_pipeline: bool = False  # a single instance that is a stage of a running pipeline

    @property
    def raw_ttft_s(self) -> float:
        return self.transfer_s + self.queue_s + self.prefill_s

    @property
    def ttft_s(self) -> float:
        return self.factor * self.raw_ttft_s


@dataclass
class PlacementPolicy:
    """Algorithm 1 with cache load balancing: picks a request's prefill and decode instances."""

    clock: Clock
    cost: CostModel
    ttft_slo_s: float = defaults.TTFT_SLO_S
    tbt_slo_s: float = defaults.TBT_SLO_S
    balancing_threshold: float = DEFAULT_BALANCING_THRESHOLD
    strategy: str = "global"
    dead_after_s: float = defaults.DEAD_AFTER_S
    min_retry_after_s: float = 1.0
    # A report counts as covering a dispatch only if generated this long after it: a
    # report taken while the task was still on the wire would otherwise erase its work.
    report_grace_s: float = 0.0
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    # None: the fixed balancing_threshold; else tuned online from observed TTFTs.
    adaptive: AdaptiveThreshold | None = None
    # False: never reject on the predicted TBT here (the paper's baseline).
    tbt_check: bool = True
    # Per-instance fitted models (None: a book of this policy's own, fed by the reports).
    book: CalibrationBook | None = None
    # Scale each instance's TTFT predictions by its observed/predicted ratio (None: off,
    # as in the simulator, whose instances run exactly the cost model).
    feedback: TtftFeedback | None = None
    # Share of the TTFT SLO a placement plans to fill: the rest absorbs the spread of
    # actual TTFT around the prediction, so the accepted requests' p90 (not their
    # mean) meets the SLO. 1.0 in the simulator, whose instances run the model exactly.
    ttft_margin: float = 1.0
    # Place a request on an idle instance whatever its predicted TTFT or TBT: nothing
    # queues ahead of it, so no later placement is faster and a 429 "retry later" would
    # be false; and a model predicting too slow (a CPU under load at warm-up) would
    # otherwise turn every request away and never get the sample that corrects it.
    # False (the paper's Algorithm 1, the simulator): reject what misses the SLO.
    serve_when_idle: bool = False
    # Chunked pipeline parallelism: groups of cpp.group_size prefill instances compete
    # with the single instances (group_size 1: off).
    cpp: cpp_.CppConfig = field(default_factory=cpp_.CppConfig)
    # Spreads the Retry-After of requests turned away for a full prefill pool over the
    # time the pool needs to serve them (services/policy/retry_schedule.py).
    retries: RetrySchedule = field(default_factory=RetrySchedule)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, not {self.strategy!r}")
        self.loads = LoadBook(
            self.clock, self.cost, dead_after_s=self.dead_after_s, calibration=self.book
        )
        self._book = self.book = self.loads.calibration
        self._prefill = self.loads.prefill  # latest reports by instance (the LoadBook's)
        self._decode = self.loads.decode
        self._dispatches: dict[str, _Dispatch] = {}
        self._by_prefill: dict[str, dict[str, _Dispatch]] = {}
        self._by_decode: dict[str, dict[str, _Dispatch]] = {}
        self._by_source: dict[str, dict[str, _Dispatch]] = {}
        # source node -> its pulls in flight with bytes > 0 (_least_inflight)
        self._loaded: dict[str, int] = {}
        self._pipelines: dict[str, _Dispatch] = {}  # pipelined, first token not out yet
        # member -> its pipelines in _pipelines (in their order there): queue_s and
        # in_pipeline read an instance's own, not every pipeline in flight.
        self._stages_on: dict[str, dict[str, _Dispatch]] = {}
        self.orders = search.Orders()  # for the pruned search (services.conductor.search)
        # False: every placement scans every live instance (the reference the pruned
        # search is tested against).
        self.pruned = True
        self.stats: dict[str, int] = dict.fromkeys(
            ("placed", "pulls", "pulled_blocks", "rejected_ttft", "rejected_tbt", "unavailable"),
            0,
        )

    @property
    def tbt_rule(self) -> TbtCheck:
        """The TBT rule admission and the decode side apply too (max_load 1 here)."""
        return TbtCheck(1.0, self.serve_when_idle)

    def threshold(self) -> float:
        """The kvcache_balancing_threshold in force now."""
        return self.adaptive.threshold if self.adaptive is not None else self.balancing_threshold

    # ------------------------------------------------------------ observations

    def observe_prefill(self, load: PrefillLoad) -> None:
        old = self._prefill.get(load.instance)
        verdict = self.loads.observe_prefill(load)
        if verdict == STALE:
            return
        self.orders.moved(load.instance, old.node if old is not None else None, load.node)
        for d in list(self._by_prefill.get(load.instance, {}).values()):
            # A new incarnation holds none of what was booked on the old one.
            if verdict == RESTARTED or d.placed_at + self.report_grace_s <= load.ts:
                self._close_prefill(d, source_too=False, only=load.instance)
        self._touch_prefill(load.instance)

    def observe_decode(self, load: DecodeLoad) -> None:
        old = self._decode.get(load.instance)
        verdict = self.loads.observe_decode(load)
        if verdict == STALE:
            return
        old_node = old.node if old is not None else None
        self.orders.moved(load.instance, old_node, load.node, Role.DECODE)
        for d in list(self._by_decode.get(load.instance, {}).values()):
            if verdict == RESTARTED or (d.decode_since is not None and d.decode_since <= load.ts):
                self._close_decode(d)
        self._touch_decode(load.instance)

    def forget_instance(self, role: str, instance: str) -> None:
        old = (self._prefill if role == Role.PREFILL else self._decode).get(instance)
        self.loads.forget(role, instance)
        if old is not None:
            self.orders.moved(instance, old.node, None, role)
        self._touch_prefill(instance)
        self._touch_decode(instance)

    def prune(self, older_than_s: float) -> int:
        """Forget instances silent for more than ``older_than_s`` (LoadBook.prune) and
        drop them from the search's orders and node maps; how many. Periodic (the
        service's sweep), not per request: it walks the orders."""
        gone = self.loads.prune(older_than_s)
        orders = self.orders
        for instance in [i for i in orders.prefill.instances() if i not in self._prefill]:
            orders.drop(instance)
        for instance in [i for i in orders.decode.instances() if i not in self._decode]:
            orders.decode.discard(instance)
        for by_node, books in (
            (orders.on_node, self._prefill),
            (orders.decode_on_node, self._decode),
        ):
            for node in list(by_node):
                held = by_node[node]
                held -= {i for i in held if i not in books or books[i].node != node}
                if not held:
                    del by_node[node]
        return gone

    def _touch_prefill(self, instance: str) -> None:
        """Re-key ``instance`` in the prefill order: the queued work ``queue_s`` sums for
        a request that interleaves (at most what any request waits for there)."""
        load = self._prefill.get(instance)
        if load is None:
            self.orders.drop(instance)
            return
        key = load.queued_work_s
        for d in self._by_prefill.get(instance, {}).values():
            if not d.stage_work:
                key += d.work_on(instance)
        self.orders.set_prefill(instance, key)
        self.orders.groups.touched(instance)

    def _models_changed(self) -> None:
        """Follow the cost models that changed since the last placement: the decode keys'
        last term now, the prefill coefficient orders (search.FitOrders) when the
        prefill walk needs them."""
        changed = self._book.floor.changed
        if changed:
            names = set(changed)
            changed.clear()
            self.orders.fits.dirty |= names
            for instance in names:
                if instance in self.orders.decode:
                    self._touch_decode(instance)

    def _touch_decode(self, instance: str) -> None:
        """Re-key ``instance`` in the decode order: (decode_occupancy, KV tokens as
        predicted_tbt sums them), then the rest of predicted_tbt's inputs, so that equal
        keys predict equal TBTs under one model (the search's ties); last, the TBT its
        own model predicts before anything joins (at most what it predicts once a
        request joins: the decode walk passes over the rest of a group of equal inputs
        from the first above the best TBT, under models of their own; 0 on the prior)."""
        load = self._decode.get(instance)
        if load is None:
            self.orders.decode.discard(instance)
            return
        pending = self._by_decode.get(instance, {})
        waiting = load.waiting + _seqs(pending)
        occupancy = (load.batch_size + waiting + 1) / max(1, load.max_batch)
        kv = load.kv_tokens + sum(d.tokens for d in pending.values())
        # On the prior (one model for all) 0, a bound too: equal inputs tie there anyway.
        model = self._book.cost(instance)
        before = (
            0.0
            if model is self._book.prior
            else model.decode_tbt(load.batch_size + waiting, kv, load.max_batch)
        )
        key = (occupancy, kv, load.batch_size, waiting, load.max_batch, before)
        self.orders.decode.set(instance, key)
        if load.max_batch <= 0:
            self.orders.decode_uncapped.add(instance)
        else:
            self.orders.decode_uncapped.discard(instance)

    def prefill_done(
        self, request_id: str, ts: float | None = None, handoff_ts: float | None = None
    ) -> None:
        """The first token is out (at ``ts``) and the request handed to its decode
        instance (at ``handoff_ts``, default ``ts``): the prefill work and the pull are
        over; the decode instance carries the request until a report at or after the
        handoff includes it."""
        ts = self.clock.now() if ts is None else ts
        self._pop_pipeline(request_id)
        if self.adaptive is not None:
            self.adaptive.first_token(request_id, ts)
        d = self._dispatches.get(request_id)
        if d is None:
            return
        if self.feedback is not None:
            key = _group_key(d.stage_work) if d.stage_work else d.prefill_instance
            self.feedback.observe(key, d.est_ttft_s, ts - d.placed_at)
        self._close_prefill(d, source_too=True)
        if d.request_id in self._dispatches:
            d.decode_since = ts if handoff_ts is None else max(ts, handoff_ts)

    def release(self, request_id: str) -> None:
        """Forget a dispatch entirely (rolled back, failed or finished)."""
        if self.adaptive is not None:
            self.adaptive.forget(request_id)
        self._pop_pipeline(request_id)
        d = self._dispatches.get(request_id)
        if d is None:
            return
        self._close_prefill(d, source_too=True)
        self._close_decode(d)

    # ------------------------------------------------------------ views

    def on_nodes(self, role: str, nodes: Iterable[str]) -> dict[str, str]:
        """instance -> node for the ``role`` instances whose last report names one of
        ``nodes`` (from the node maps: no walk over every instance)."""
        by_node = self.orders.on_node if role == Role.PREFILL else self.orders.decode_on_node
        books = self._prefill if role == Role.PREFILL else self._decode
        out = {}
        for node in nodes:
            for i in by_node.get(node, ()):
                ld = books.get(i)
                if ld is not None and ld.node == node:
                    out[i] = node
        return out

    def live_prefill(self) -> list[str]:
        return [load.instance for load in self.loads.live_prefill()]

    def live_decode(self) -> list[str]:
        return [load.instance for load in self.loads.live_decode()]

    def queue_s(self, instance: str, interleave: bool = False) -> float:
        """Seconds of prefill work ahead of a new request on ``instance``: its report
        plus what this policy dispatched there since. A pipeline's stage holds a member
        one chunk at a time (cpp module), so a request that ``interleave``s (one that
        computes at most ``cpp.interleave_tokens``) waits only for what the report shows
        queued; any other waits for the stages still to run there too."""
        load = self._prefill.get(instance)
        base = load.queued_work_s if load else 0.0
        own = self._by_prefill.get(instance, {})
        for d in own.values():
            if not (interleave and d.stage_work):
                base += d.work_on(instance)
        if not interleave:
            now = self.clock.now()
            for d in self._stages_on.get(instance, {}).values():
                if d.request_id not in own:
                    base += max(0.0, d.stage_end_at[instance] - now)
        return base

    def in_pipeline(self, instance: str) -> bool:
        """``instance`` is a stage of a pipeline whose first token is not out yet."""
        return bool(self._stages_on.get(instance))

    def _add_pipeline(self, d: _Dispatch) -> None:
        self._pipelines[d.request_id] = d
        for m in d.stage_end_at:
            self._stages_on.setdefault(m, {})[d.request_id] = d

    def _pop_pipeline(self, request_id: str) -> None:
        d = self._pipelines.pop(request_id, None)
        if d is None:
            return
        for m in d.stage_end_at:
            on = self._stages_on.get(m)
            if on is not None:
                on.pop(request_id, None)
                if not on:
                    del self._stages_on[m]

    def inflight_bytes(self, node: str) -> float:
        return sum(d.transfer_bytes for d in self._by_source.get(node, {}).values())

    def _least_inflight(self, nodes: Collection[str]) -> str:
        """``min(nodes, key=(inflight_bytes, name))`` in set operations: the least name
        of the nodes with no positive bytes in flight (``_loaded`` counts the pulls
        with bytes per source), summed one by one only when every node has some. A
        prefix every node holds does not cost a Python step per node."""
        loaded = self._loaded
        if not loaded:
            return min(nodes)
        held = nodes if isinstance(nodes, (set, frozenset)) else set(nodes)
        # Bytes are never negative: a node with no positive pull in flight has 0, the
        # least there is, and among those the first name wins.
        idle = held.difference(loaded)
        if idle:
            return min(idle)
        return min((self.inflight_bytes(n), n) for n in held)[1]

    def _least_inflight_of(self, group: NodeGroup, excluded: Collection[str]) -> str | None:
        """``_least_inflight`` of the group less ``excluded`` (None when that leaves
        none): the group's least name outside the loaded sources, found in a walk over
        the names in order that passes only those; summed one by one only when every
        node has pulls in flight."""
        loaded = self._loaded
        node = group.least(loaded.keys() | excluded if excluded else loaded)
        if node is not None:
            return node
        rest = [n for n in group if n not in excluded]  # every one has pulls in flight
        return self._least_inflight(rest) if rest else None

    def predicted_tbt(self, instance: str, num_tokens: int, seqs: int = 1) -> float:
        """Decode step time on ``instance`` once a request of ``num_tokens`` (and
        ``seqs`` sequences, OpenAI's n) joins."""
        load = self._decode[instance]
        pending = self._by_decode.get(instance, {})  # placed here, not yet in its reports
        return self._book.cost(instance).tbt_joining(
            load.batch_size,
            load.waiting + _seqs(pending),
            load.kv_tokens + sum(d.tokens for d in pending.values()),
            num_tokens,
            load.max_batch,
            seqs,
        )

    def decode_occupancy(self, instance: str) -> float:
        """Fraction of ``instance``'s batch slots taken once one more request joins."""
        load = self._decode[instance]
        taken = load.batch_size + load.waiting + _seqs(self._by_decode.get(instance, {})) + 1
        return taken / max(1, load.max_batch)

    def decode_idle(self, instance: str) -> bool:
        """Nothing runs, waits or is placed on ``instance`` (as far as this policy knows)."""
        load = self._decode[instance]
        return load.batch_size + load.waiting + _seqs(self._by_decode.get(instance, {})) == 0

    def _pick_decode(self, decodes: list[str], tbts: Mapping[str, float], slo: float) -> str:
        # Balance load among the instances that meet the TBT SLO (the paper's
        # SelectDecodingInstance). Picking the smallest predicted TBT instead sends every
        # request to whichever instance's calibration came out a hair faster: decode
        # steps barely grow with the batch, so fit noise outweighs the load.
        fits = [i for i in decodes if tbts[i] <= slo]
        if not fits:
            return min(decodes, key=lambda i: (tbts[i], i))
        return min(fits, key=lambda i: (self.decode_occupancy(i), tbts[i], i))

    def dispatched(self) -> list[str]:
        return sorted(self._dispatches)

    # ------------------------------------------------------------ placement

    def place(
        self,
        req: PlacementRequest,
        matches: Mapping[str, int],
        *,
        exclude_prefill: Iterable[str] = (),
        exclude_decode: Iterable[str] = (),
        exclude_sources: Iterable[str] = (),
    ) -> Decision:
        """Choose (prefill, decode) for ``req`` given the shadow index's ``matches``
        (node -> prefix length in blocks), and record the dispatch on success."""
        self.release(req.request_id)  # a retry replaces the earlier attempt
        ex_p, ex_d = set(exclude_prefill), set(exclude_decode)
        own, groups = _holder_groups(matches, len(req.block_hashes))
        ex_s = set(exclude_sources)
        best_len, best_node = 0, None
        for length in sorted(groups, reverse=True):
            group = groups[length]
            if isinstance(group, NodeGroup):  # many nodes: no step per node
                node = self._least_inflight_of(group, ex_s)
                if node is not None:
                    best_len, best_node = length, node
                    break
                continue
            nodes = set(group).difference(ex_s) if ex_s else group
            if nodes:
                best_len, best_node = length, self._least_inflight(nodes)
                break
        ttft_slo = self.ttft_slo_s if req.ttft_slo_s is None else req.ttft_slo_s
        tbt_slo = self.tbt_slo_s if req.tbt_slo_s is None else req.tbt_slo_s

        if self.pruned:
            # The same choice as the scan below, from a few candidates (search module).
            self._models_changed()
            pool = search.live_pool(self, ex_p) if self.strategy == "random" else None
            found = None
            if pool is None:
                found = search.best_prefill(self, req, own, best_len, best_node, ex_p, groups)
                if found is not None and self.cpp.enabled and self.strategy != "load":
                    found = search.best_group(self, req, own, ex_p, found, groups)
            none_left = found is None if pool is None else not len(pool)
            if none_left:
                self.stats["unavailable"] += 1
                return Rejection(
                    ErrorCode.UNAVAILABLE, "no live prefill instance", self.min_retry_after_s
                )
            picked = search.best_decode(self, req.num_tokens, tbt_slo, ex_d, req.seqs)
            if picked is None:
                self.stats["unavailable"] += 1
                return Rejection(
                    ErrorCode.UNAVAILABLE, "no live decode instance", self.min_retry_after_s
                )
            decode, decode_tbt = picked
            if pool is not None:  # drawn as the scan draws, once both pools are known
                [found] = self._candidates(req, [self.rng.choice(pool)], own, best_len, best_node)
            assert found is not None
            chosen = found
        else:
            prefills = [i for i in self.live_prefill() if i not in ex_p]
            if not prefills:
                self.stats["unavailable"] += 1
                return Rejection(
                    ErrorCode.UNAVAILABLE, "no live prefill instance", self.min_retry_after_s
                )
            decodes = [i for i in self.live_decode() if i not in ex_d]
            if not decodes:
                self.stats["unavailable"] += 1
                return Rejection(
                    ErrorCode.UNAVAILABLE, "no live decode instance", self.min_retry_after_s
                )
            cands = self._candidates(req, prefills, own, best_len, best_node)
            if self.strategy == "random":
                chosen = self.rng.choice(cands)
            elif self.strategy == "load":
                chosen = min(cands, key=lambda c: (c.queue_s, c.instance))
            else:
                # A group wins only when strictly faster: on a tie the request stays single.
                cands += self._group_candidates(req, prefills, own)
                # On a tie a short request goes where no pipeline would be stretched by it.
                chosen = min(cands, key=search.rank)
            tbts = {i: self.predicted_tbt(i, req.num_tokens, req.seqs) for i in decodes}
            decode = self._pick_decode(decodes, tbts, tbt_slo)
            decode_tbt = tbts[decode]
        # Clamped: a gateway clock ahead of this one must not make time run backwards.
        now = self.clock.now()
        waited = max(0.0, now - req.arrival_ts) if req.arrival_ts else 0.0
        idle_prefill = self.serve_when_idle and chosen.queue_s <= 0
        budget = ttft_slo * self.ttft_margin
        # Retries promised room before this request would start are queued ahead of it,
        # unless its own work is short enough to pass them (RetrySchedule.passes).
        key = (req.block_hashes[-1], req.num_tokens) if req.block_hashes else None
        promised = 0.0
        if self.retries.reserve:
            made = self.retries.claim(key, now)
            if not self.retries.passes(chosen.transfer_s + chosen.prefill_s, budget - waited):
                promised = self.retries.ahead(now, now + chosen.queue_s, made)
        ttft = chosen.ttft_s + promised
        if waited + ttft > budget and not idle_prefill:
            self.stats["rejected_ttft"] += 1
            late = f" after {waited:.3f}s before placement" if waited >= 0.001 else ""
            held = f" ({promised:.3f}s of it promised to retries)" if promised else ""
            return Rejection(
                ErrorCode.REJECTED,
                f"predicted TTFT {ttft:.3f}s{held}{late} exceeds the {ttft_slo:g}s SLO"
                + (f" (planned to {self.ttft_margin:.0%})" if self.ttft_margin < 1 else ""),
                self.retries.retry_after(
                    now,
                    max(self.min_retry_after_s, waited + ttft - budget),
                    chosen.prefill_s,
                    len(search.live_pool(self, ())),
                    backlog_s=chosen.queue_s,
                    budget_s=budget - waited - chosen.transfer_s,
                    key=key,
                ),
            )
        if self.tbt_check and self.tbt_rule.over(decode_tbt, tbt_slo, self.decode_idle(decode)):
            self.stats["rejected_tbt"] += 1
            return Rejection(
                ErrorCode.REJECTED,
                f"predicted TBT {decode_tbt:.4f}s exceeds the {tbt_slo:g}s SLO",
                self.min_retry_after_s,
            )

        remote = chosen.remote
        d = _Dispatch(
            request_id=req.request_id,
            prefill_instance=chosen.instance,
            decode_instance=decode,
            source_node=remote.node if remote else None,
            transfer_bytes=self.cost.kv_bytes(remote.num_blocks * req.block_size)
            if remote
            else 0.0,
            work_s=chosen.transfer_s + chosen.prefill_s,
            tokens=req.num_tokens * req.seqs,
            seqs=req.seqs,
            placed_at=self.clock.now(),
            est_ttft_s=chosen.raw_ttft_s,
            stage_work=dict(zip(chosen.stages, chosen.stage_work, strict=True)),
            stage_end_at={
                m: self.clock.now() + e
                for m, e in zip(chosen.stages, chosen.stage_end_s, strict=True)
            },
        )
        self._record(d)
        if chosen.stages:
            self._add_pipeline(d)
        self.stats["placed"] += 1
        if remote is not None:
            self.stats["pulls"] += 1
            self.stats["pulled_blocks"] += remote.num_blocks
        if self.adaptive is not None:
            self.adaptive.record(req.request_id, remote is not None, chosen.ttft_s, d.placed_at)
        return Placement(
            request_id=req.request_id,
            prefill_instance=chosen.instance,
            prefill_node=chosen.node,
            decode_instance=decode,
            decode_node=self._decode[decode].node,
            prefix_blocks=chosen.prefix_blocks,
            prefix_tokens=chosen.prefix_blocks * req.block_size,
            remote=remote,
            est_ttft_s=chosen.ttft_s,
            est_queue_s=chosen.queue_s,
            est_transfer_s=chosen.transfer_s,
            est_prefill_s=chosen.prefill_s,
            est_tbt_s=decode_tbt,
            strategy=self.strategy,
            cpp_stages=chosen.stages,
            cpp_stage_nodes=chosen.stage_nodes,
            cpp_chunk_tokens=self.cpp.chunk_tokens if chosen.stages else 0,
            cpp_stage_end_s=chosen.stage_end_s,
        )

    def _candidates(
        self,
        req: PlacementRequest,
        prefills: Sequence[str],
        own: Mapping[str, int],
        best_len: int,
        best_node: str | None,
    ) -> list[_Candidate]:
        """Algorithm 1 lines 4-13 for every instance. Instances whose nodes hold the same
        prefix share one (prefix, transfer) evaluation; the prefill time is each
        instance's own."""
        inflight = self.inflight_bytes(best_node) if best_node is not None else 0.0
        threshold = self.threshold()
        options: dict[int, tuple[int, RemoteSource | None, float]] = {}
        out = []
        for instance in prefills:
            node = self._prefill[instance].node
            own_len = own.get(node, 0)
            opt = self._option(req, own_len, best_len, best_node, inflight, threshold, options)
            out.append(self._candidate(req, instance, node, own_len, opt))
        return out

    def _option(
        self,
        req: PlacementRequest,
        own_len: int,
        best_len: int,
        best_node: str | None,
        inflight: float,
        threshold: float,
        options: dict[int, tuple[int, RemoteSource | None, float]],
    ) -> tuple[int, RemoteSource | None, float]:
        """(prefix, remote, transfer_s) of an instance whose node holds ``own_len``
        blocks: Algorithm 1's choice between its own prefix and pulling the best one."""
        opt = options.get(own_len)
        if opt is None:
            prefix, remote, transfer_s = own_len, None, 0.0
            if (
                self.strategy == "global"
                and best_node is not None
                and best_len > own_len
                and _ratio(best_len, own_len) > threshold
            ):
                prefix = best_len
                remote = RemoteSource(best_node, own_len, best_len - own_len)
                transfer_s = self.cost.transfer_time(
                    (best_len - own_len) * req.block_size, inflight
                )
            opt = options[own_len] = (prefix, remote, transfer_s)
        return opt

    def _candidate(
        self,
        req: PlacementRequest,
        instance: str,
        node: str,
        own_len: int,
        opt: tuple[int, RemoteSource | None, float],
    ) -> _Candidate:
        prefix, remote, transfer_s = opt
        computed_prefix = _computed_prefix(req, prefix)
        prefill_s = self._book.cost(instance).prefill_time(req.num_tokens, computed_prefix)
        interleave = (
            self.cpp.enabled and req.num_tokens - computed_prefix <= self.cpp.interleave_tokens
        )
        return _Candidate(
            instance=instance,
            node=node,
            own_blocks=own_len,
            prefix_blocks=prefix,
            remote=remote,
            queue_s=self.queue_s(instance, interleave),
            transfer_s=transfer_s,
            prefill_s=prefill_s,
            factor=self.feedback.factor(instance) if self.feedback else 1.0,
            in_pipeline=self.cpp.enabled and self.in_pipeline(instance),
        )

    def _group_candidates(
        self, req: PlacementRequest, prefills: Sequence[str], own: Mapping[str, int]
    ) -> list[_Candidate]:
        """Every CPP group of live instances as one candidate (services.policy.chunk_timing):
        its members' longest own prefix, the other stages' slices of it from the
        anchor, and the pipeline's timing with each stage starting once its member's
        queue is done."""
        if not self.cpp.enabled:
            return []
        out = []
        for members in cpp_.form_groups(prefills, self.cpp.group_size):
            c = self._group_candidate(req, members, own)
            if c is not None:
                out.append(c)
        return out

    def _group_candidate(
        self, req: PlacementRequest, members: Sequence[str], own: Mapping[str, int]
    ) -> _Candidate | None:
        """One CPP group as a candidate (:meth:`_group_candidates`); None when it leaves
        fewer than ``cpp.min_tokens`` to compute."""
        node_of = {m: self._prefill[m].node for m in members}
        anchor = cpp_.anchor_of(members, node_of, own)
        prefix = own.get(node_of[anchor], 0)
        computed_prefix = _computed_prefix(req, prefix)
        if req.num_tokens - computed_prefix < self.cpp.min_tokens:
            return None
        slices_s = 0.0
        if computed_prefix > 0:
            slices_s = self.cost.transfer_time(
                0,
                self.cost.kv_bytes(1) * cpp_.slice_tokens(computed_prefix, len(members))
                + self.inflight_bytes(node_of[anchor]),
            )
        by_member = {m: self.queue_s(m) for m in members}
        stages = cpp_.order_stages(members, by_member, anchor)
        queues = [by_member[m] for m in stages]
        timing = cpp_.pipeline_timing(
            [self._book.cost(m) for m in stages],
            req.num_tokens,
            computed_prefix,
            self.cpp.chunk_tokens,
            link=self.cost,
            ready=cpp_.ready_times(queues, slices_s, stages.index(anchor)),
        )
        # The queues and slices overlap the pipeline: the timing holds them all.
        return _Candidate(
            instance=anchor,
            node=node_of[anchor],
            own_blocks=prefix,
            prefix_blocks=prefix,
            remote=None,
            queue_s=queues[0],
            transfer_s=0.0,
            prefill_s=timing.ttft_s - queues[0],
            factor=self._group_factor(stages),
            stages=stages,
            stage_nodes=tuple(node_of[m] for m in stages),
            stage_end_s=timing.stage_end_s,
            stage_work=tuple(cpp_.member_work(queues, timing)),
        )

    def _group_factor(self, members: Sequence[str]) -> float:
        """A group's TTFT feedback: its pipelines' own observed/predicted ratio (their
        hand-offs and stage coordination are no part of a member's requests alone), and
        until it has served one, its slowest member's."""
        if self.feedback is None:
            return 1.0
        own = self.feedback.factors.get(_group_key(members))
        return own if own is not None else max(self.feedback.factor(m) for m in members)

    # ------------------------------------------------------------ bookkeeping

    def _record(self, d: _Dispatch) -> None:
        self._dispatches[d.request_id] = d
        for m in d.prefill_members():
            self._by_prefill.setdefault(m, {})[d.request_id] = d
        self._by_decode.setdefault(d.decode_instance, {})[d.request_id] = d
        if d.source_node is not None:
            self._by_source.setdefault(d.source_node, {})[d.request_id] = d
            if d.transfer_bytes > 0:
                self._loaded[d.source_node] = self._loaded.get(d.source_node, 0) + 1
        for m in d.prefill_members():
            self._touch_prefill(m)
        self._touch_decode(d.decode_instance)

    def _close_prefill(self, d: _Dispatch, source_too: bool, only: str | None = None) -> None:
        """Drop the prefill work of ``d`` from its instances (``only``: from that one, as
        its report now covers it; a pipelined request stays open on the others)."""
        for m in d.prefill_members() if only is None else (only,):
            if self._by_prefill.get(m, {}).pop(d.request_id, None) is not None:
                self._touch_prefill(m)
        d.prefill_open = any(
            d.request_id in self._by_prefill.get(m, {}) for m in d.prefill_members()
        )
        if source_too and d.source_node is not None:
            pulls = self._by_source.get(d.source_node)
            if pulls is not None and pulls.pop(d.request_id, None) is not None:
                if not pulls:  # only the nodes with pulls in flight
                    del self._by_source[d.source_node]
                if d.transfer_bytes > 0:
                    left = self._loaded[d.source_node] - 1
                    if left:
                        self._loaded[d.source_node] = left
                    else:
                        del self._loaded[d.source_node]
            d.source_node = None
        self._maybe_drop(d)

    def _close_decode(self, d: _Dispatch) -> None:
        if self._by_decode.get(d.decode_instance, {}).pop(d.request_id, None) is not None:
            self._touch_decode(d.decode_instance)
        d.decode_since = -math.inf
        self._maybe_drop(d)

    def _maybe_drop(self, d: _Dispatch) -> None:
        in_decode = d.request_id in self._by_decode.get(d.decode_instance, {})
        if not d.prefill_open and d.source_node is None and not in_decode:
            self._dispatches.pop(d.request_id, None)


def _group_key(members: Iterable[str]) -> str:
    """The TTFT feedback's key of a CPP group (any stage order)."""
    return "cpp:" + "+".join(sorted(members))


def _holder_groups(
    matches: Mapping[str, int], nblocks: int
) -> tuple[Mapping[str, int], dict[int, list[str]]]:
    """(node -> own prefix in blocks, capped at the request's ``nblocks``, nodes
    matching nothing left out; the same nodes grouped by length). The prefix index's
    :class:`~services.conductor.prefix_index.Matches` carries the groups: taken as
    they are (no step per node) when no length needs capping."""
    by_length: dict[int, list[str]] | None = getattr(matches, "by_length", None)
    if by_length is not None and (not by_length or max(by_length) <= nblocks):
        return matches, by_length
    own = {node: min(n, nblocks) for node, n in matches.items() if n > 0}
    groups: dict[int, list[str]] = {}
    for node, n in own.items():
        groups.setdefault(n, []).append(node)
    return own, groups


def _ratio(best: int, own: int) -> float:
    return math.inf if own == 0 else best / own


def _computed_prefix(req: PlacementRequest, prefix_blocks: int) -> int:
    """Tokens of the prompt whose KV is reused (search.computed_prefix)."""
    return search.computed_prefix(req.num_tokens, req.block_size, prefix_blocks)


def _seqs(pending: Mapping[str, _Dispatch]) -> int:
    """Decode sequences of the requests placed on an instance and not yet in its
    reports (a report counts each of a request's n sequences as one request)."""
    return sum(d.seqs for d in pending.values())
