"""The simulator: a trace replayed through the live system's own policy objects.

Per request (times from the cost model, decisions from the real classes)::

    arrival --dispatch_s--> AdmissionPolicy.decide --> Rejection ("admission")
      --PlacementPolicy.place(PrefixIndex.match)--> Rejection ("conductor")
      --> prefill instance FIFO (no store slots held while queued)
      --> compute starts: TxAllocate PREFILL/DECODE/SOURCE on the stores (BlockPool),
          read by services.common.reservation as services/prefill/reserve.py reads it:
          a SOURCE that refuses is dropped (computed here), a store short of room is
          asked again every ``reserve_retry_s`` for up to ``reserve_wait_s`` (the
          instance waits), anything else fails it -> Rejection ("prefill"); the pull
          is trimmed to what the prefill node lacks
      --> [pull] compute
      --> first token: out to the client at once (+ first_token_hop_s), while the KV
          streams to the decode node (``PrefillTask.stream_first_token``)
      --> KV landed: FirstTokenNotice (policy.prefill_done: first token at the compute's
          end, handed to decode now; TxCommit of the prefill and source transactions,
          events -> PrefixIndex)
      --> baseline admission only: decode instance over its TBT SLO -> Rejection ("decode"),
          the prefill was wasted (paper §4.3.2); else the first token goes out now
      --> continuous batching --> done: policy.release

Load reports: with ``report_interval_s == 0`` both policies get an exact snapshot of
every instance right before each decision (only the instances whose load may have
changed report, which gives the same books at a cost that follows the changes, not
the cluster: :meth:`Simulator.refresh`). With ``report_interval_s > 0`` every
instance reports on its own timer, as the live workers do (``--report-interval``): the
first report at the first arrival, then every ``report_interval_s`` from a phase drawn
per instance (seeded), so decisions see reports up to one interval old and the
policies' dispatch accounting (``PlacementPolicy.report_grace_s``) bridges the gap.

Control-plane latency of the live stack (zero by default, the paper's model):
``dispatch_s`` from arrival to the placed request sitting in its prefill queue (HTTP,
gateway, admission, conductor: bus hops), ``first_token_hop_s``
from the first token's computation to the client, and ``prefill_handoff_s``, the
prefill instance's busy time after each compute (the worker publishes the first token
and turns around to its next task; the KV acks and the handoff run beside that task).
:func:`simulate_slice` sets them to what the live stack measures (``LIVE_*``).
Everything reads one :class:`ManualClock`.
"""

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from bus_schemas.control import Refused
from bus_schemas.roles import Role
from perigee.sim.cluster import Cluster, Link
from perigee.sim.events import EventLoop
from perigee.sim.gc_policy import lean_gc, paused_gc
from perigee.sim.instances import DecodeInstance, PrefillInstance
from perigee.sim.pipeline_gang import Gang
from perigee.sim.request import SimRequest
from perigee.trace import TRACE_BLOCK, PromptBuilder, TraceRequest
from services.admission.admission_policy import (
    AdmissionPolicy,
    AdmissionRequest,
    make_admission_policy,
)
from services.common import admission_mode, defaults
from services.common import reservation as plan
from services.common.cost_model import CostModel
from services.common.rejection import Rejection
from services.conductor import placement_round
from services.conductor.balancing import AdaptiveThreshold
from services.conductor.placement_policy import (
    DEFAULT_BALANCING_THRESHOLD,
    PlacementPolicy,
    PlacementRequest,
)
from services.policy.chunk_timing import DEFAULT_CHUNK_TOKENS, CppConfig
from services.policy.decode_side_check import DecodeSideCheck

# What the live stack (perigee.stack, mock engine, one host) adds to the cost model,
# measured by scripts/measure_live_overheads.py in the configuration of
# tests/e2e/test_live_vs_sim.py on the 2-core development machine: medians over 3 runs
# of 80 requests (per-run medians in parentheses, ms):
#   dispatch: client -> gateway 1.4 (1.39-1.56) + gateway -> prefill queue 8.3
#             (6.7-9.0: admission, conductor placement, TxAllocate round trip, hops)
#   first-token hop: the mock's pacing overrun 0.9 (0.92-0.97) + compute end -> client
#             2.3 (2.19-2.42)
#   prefill handoff: overrun 0.9 + compute end -> next task's compute start 1.0
#             (0.98-2.03: the first token's publish, the runner's turnaround and the
#             event-loop share of the previous requests' ships and handoffs)
# Each has a long tail on a loaded machine (p90 up to 45 ms); the simulator takes the
# median as a constant. Measured when the conductor still allocated store slots at
# placement: the TxAllocate round trip now sits at the prefill's compute start instead
# (not remeasured; the simulator's reservation takes no time).
LIVE_DISPATCH_S = 0.010
LIVE_FIRST_TOKEN_HOP_S = 0.003
LIVE_PREFILL_HANDOFF_S = 0.002


@dataclass
class SimConfig:
    """A simulation's settings: pool sizes, policies, cache sizes, SLOs and trace speed."""

    prefill: int = 8
    decode: int = 8
    policy: str = "global"  # random | load | local | global
    admission: str = "early"  # services.common.admission_mode: baseline | early | predict
    cache_tokens_per_node: int = 3_000_000
    decode_cache_tokens: int | None = None  # None: as prefill nodes; 0: decode nodes cache nothing
    block_size: int = TRACE_BLOCK
    speed: float = 1.0  # trace timestamps are divided by this
    ttft_slo_s: float = defaults.TTFT_SLO_S
    tbt_slo_s: float = defaults.TBT_SLO_S
    max_batch: int = 128
    chunk_tokens: int = 0  # 0: a prompt's suffix in one chunk
    cpp_group: int = 1  # chunked pipeline parallelism: prefill instances per group (1: off)
    cpp_chunk_tokens: int = DEFAULT_CHUNK_TOKENS  # the pipeline's prefill_chunk
    balancing_threshold: float = DEFAULT_BALANCING_THRESHOLD
    adaptive_threshold: bool = False  # tune it online (services.conductor.balancing)
    output_tokens: int | None = None  # force every output length (paper §7.3.2 uses 1)
    output_scale: float = 1.0  # as perigee replay
    max_output: int = 1 << 30
    report_interval_s: float = 0.0  # 0: fresh snapshots before every decision; else timers
    dispatch_s: float = 0.0  # arrival -> placed and queued on its prefill instance
    first_token_hop_s: float = 0.0  # first token computed -> the client has it
    prefill_handoff_s: float = 0.0  # a prefill instance's busy time after each compute
    reserve_wait_s: float = plan.WAIT_S  # a reservation waits this long for store room
    reserve_retry_s: float = plan.RETRY_S  # asking again this often
    sample_interval_s: float = 10.0  # load time series (plots, P/D controller)
    pd_controller: bool = False  # resize the pools with the conductor's P/D controller
    pd_kw: dict = field(default_factory=dict)  # PoolResizer options (interval_s, window_s...)
    # report_interval_s == 0: report only the instances whose load may have changed
    # (exactly what reporting all would give; False: all, the reference)
    incremental_reports: bool = True
    seed: int = 0
    # The decode node writes each answer's blocks back (issue 24), as inferred from the
    # trace by perigee.sim.writeback's rule.
    decode_writeback: bool = False
    cost: CostModel = field(default_factory=CostModel)
    admission_kw: dict = field(default_factory=dict)
    placement_kw: dict = field(default_factory=dict)


class Simulator:
    """Replays a trace through the live admission and placement policies on simulated time."""

    def __init__(
        self,
        trace: Sequence[TraceRequest],
        cfg: SimConfig,
        *,
        placement_cls: type[PlacementPolicy] = PlacementPolicy,
        admission: Callable[..., AdmissionPolicy] | None = None,
        progress: bool = False,
    ) -> None:
        import random

        self.cfg = cfg
        self.loop = EventLoop()
        clock, cost = self.loop.clock, cfg.cost
        self.cost = cost
        self.cluster = Cluster(cost, clock, cfg.block_size)
        # What each service does in this admission mode, as the live services read it
        # (baseline: no TBT check at placement, the decode instance rejects after the
        # prefill).
        mode = admission_mode.behaviour(cfg.admission)
        self.decode_gate = DecodeSideCheck(cost, cfg.tbt_slo_s) if mode.decode_gate else None
        adaptive = None
        if cfg.adaptive_threshold:
            adaptive = AdaptiveThreshold(
                clock, initial=cfg.balancing_threshold, hi=max(16.0, cfg.balancing_threshold)
            )
        self.placement = placement_cls(
            clock,
            cost,
            ttft_slo_s=cfg.ttft_slo_s,
            tbt_slo_s=cfg.tbt_slo_s,
            balancing_threshold=cfg.balancing_threshold,
            strategy=cfg.policy,
            rng=random.Random(cfg.seed),
            adaptive=adaptive,
            cpp=CppConfig(cfg.cpp_group, cfg.cpp_chunk_tokens),
            **{"tbt_check": mode.placement_tbt_check, **cfg.placement_kw},
        )
        make = admission or make_admission_policy
        self.admission = make(
            cfg.admission,
            clock,
            cost,
            ttft_slo_s=cfg.ttft_slo_s,
            tbt_slo_s=cfg.tbt_slo_s,
            **cfg.admission_kw,
        )
        self.inbound: dict[str, int] = {}  # decode instance -> placed requests not landed yet
        self.pipelined: set[str] = set()  # requests placed on a CPP group
        self._started = False
        self.links: dict[str, Link] = {}  # node -> its NIC (add_instance)
        # Incremental exact reports (refresh): what may have changed since its last
        # report, what moves with time alone, and the order the full refresh reports in.
        self._dirty: set[PrefillInstance | DecodeInstance] = set()
        self._moving: set[PrefillInstance | DecodeInstance] = set()
        self._rank: dict[PrefillInstance | DecodeInstance, tuple[int, int]] = {}
        self._incremental = False
        self._swept_at = -math.inf  # every instance reported (liveness)
        self._reported_at = -math.inf  # the last refresh
        self.prefills: dict[str, PrefillInstance] = {}
        self.decodes: dict[str, DecodeInstance] = {}
        decode_cache = (
            cfg.cache_tokens_per_node
            if cfg.decode_cache_tokens is None
            else cfg.decode_cache_tokens
        )
        for i in range(cfg.prefill + cfg.decode):
            role = Role.PREFILL if i < cfg.prefill else Role.DECODE
            node = self.cluster.add_node(
                f"n{i:02d}",
                cfg.cache_tokens_per_node if role == Role.PREFILL else decode_cache,
                role,
            )
            self.add_instance(role, node.name)
        with paused_gc():
            self.requests = [self._request(i, r, trace[0].timestamp_s) for i, r in enumerate(trace)]
        self.writeback = None
        if cfg.decode_writeback:
            from perigee.sim.writeback import SimWriteBack

            self.writeback = SimWriteBack(trace, self.cluster, cfg.block_size)
        self.by_id = {r.rid: r for r in self.requests}
        self.terminal = 0
        self._phase = random.Random(f"reports-{cfg.seed}")  # report timer phases
        self.hooks: list[Callable[[], None]] = []  # run after each refresh (P/D controller)
        self.samples: list[dict] = []
        self.resizer = None
        if cfg.pd_controller:
            from perigee.sim.pd import PoolResizer

            self.resizer = PoolResizer(self, **cfg.pd_kw)
        self._bar = None
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=len(self.requests), unit="req", mininterval=0.5)
        self.wall_s = 0.0

    # ------------------------------------------------------------ setup

    def _request(self, i: int, r: TraceRequest, base: float) -> SimRequest:
        cfg, bs = self.cfg, self.cfg.block_size
        n = r.input_length if bs == TRACE_BLOCK else PromptBuilder(bs).input_length(r)
        n = max(1, n)
        if cfg.output_tokens is not None:
            out = cfg.output_tokens
        else:
            out = max(1, min(cfg.max_output, round(r.output_length * cfg.output_scale)))
        return SimRequest(
            rid=f"r{i}",
            index=i,
            arrival=(r.timestamp_s - base) / cfg.speed,
            num_tokens=n,
            output_tokens=out,
            hashes=list(r.hash_ids[: n // bs]),
        )

    def add_instance(self, role: str, node: str) -> str:
        nd = self.cluster.nodes[node]
        nd.role = role
        # One map of every node's link, shared by the prefill instances (they pull
        # over the holder's link): adding an instance costs O(1), not O(cluster).
        links = self.links
        links[node] = nd.link
        if role == Role.PREFILL:
            inst = PrefillInstance(
                f"P-{node}",
                node,
                self.loop,
                self.cost,
                nd.link,
                links,
                self._prefilled,
                self.cfg.chunk_tokens,
                handoff_s=self.cfg.prefill_handoff_s,
                on_free=self._prefill_free,
                reserve=self._reserve,
            )
            self.prefills[inst.name] = inst
        else:
            inst = DecodeInstance(
                f"D-{node}", node, self.loop, self.cost, self._decoded, self.cfg.max_batch
            )
            self.decodes[inst.name] = inst
        self._rank[inst] = (0 if role == Role.PREFILL else 1, len(self._rank))
        inst.on_change = self._changed
        self._dirty.add(inst)
        if self._started and self.cfg.report_interval_s > 0:  # a role switch mid-run
            self.loop.at(self.loop.now(), self._report, inst)
        return inst.name

    # ------------------------------------------------------------ run

    def run(self) -> "Simulator":
        t0 = time.perf_counter()
        self._started = True
        self._incremental = self._incremental_ok()
        if self.requests:
            start = self.requests[0].arrival
            if self.cfg.report_interval_s > 0:
                for inst in [*self.prefills.values(), *self.decodes.values()]:
                    self.loop.at(start, self._report, inst)
            self.loop.at(start, self._arrive, 0)
            if self.cfg.sample_interval_s > 0:
                self.loop.at(start, self._sample)
            if self.resizer is not None:
                self.resizer.start(start)
        with lean_gc():
            self.loop.run()
        self.wall_s = time.perf_counter() - t0
        if self._bar is not None:
            self._bar.close()
        return self

    def refresh(self, force: bool = False) -> None:
        """Exact snapshots of every instance to both policies: before each decision when
        ``report_interval_s == 0``; otherwise only when ``force``d (reports come from
        the instances' own timers, :meth:`_report`)."""
        if self.cfg.report_interval_s > 0 and not force:
            return
        now = self.loop.now()
        if self._incremental and not force and now - self._swept_at < self._keepalive_s:
            self._refresh_changed(now)
        else:
            for inst in [*self.prefills.values(), *self.decodes.values()]:
                if not inst.draining:
                    self._observe(inst, now)
            self._dirty.clear()
            self._moving = {i for i in self._rank if i.moving()}
            self._swept_at = now
        self._reported_at = now
        for hook in self.hooks:
            hook()

    def _refresh_changed(self, now: float) -> None:
        """Report only what may differ from its last report: the instances changed by
        an event since, and, once time has moved, those whose load moves with it. An
        instance left out would report the same load (only ``ts`` newer), which both
        policies' observe take as a no-op (:meth:`_incremental_ok`); every
        ``_keepalive_s`` all report, so none looks dead. Per decision this costs the
        changes, not the cluster (O(n) only for the sweep, once per keep-alive)."""
        todo = self._dirty
        if now != self._reported_at and self._moving:
            todo = todo | self._moving
        self._dirty = set()
        moving, rank = self._moving, self._rank
        for inst in sorted(todo, key=rank.__getitem__):
            if inst.moving():
                moving.add(inst)
            else:
                moving.discard(inst)
            pool = self.prefills if isinstance(inst, PrefillInstance) else self.decodes
            if pool.get(inst.name) is inst and not inst.draining:
                self._observe(inst, now)

    def _changed(self, inst: PrefillInstance | DecodeInstance) -> None:
        self._dirty.add(inst)

    def _incremental_ok(self) -> bool:
        """Whether reporting only the changed instances gives the policies exactly what
        reporting all would: exact snapshots, and both policies' observe a no-op for an
        unchanged load (no time-based side effect: PlacementPolicy closes a dispatch
        at its instance's next report only without ``report_grace_s``; the predictive
        admission counts what each report saw; a CPP stage's booking closes on a member
        that no event touches)."""
        cfg, pl, ad = self.cfg, self.placement, self.admission
        if not cfg.incremental_reports or cfg.report_interval_s > 0 or cfg.cpp_group > 1:
            return False
        if getattr(pl, "report_grace_s", 0.0) != 0.0:
            return False
        base = (
            (type(pl).observe_prefill, PlacementPolicy.observe_prefill),
            (type(pl).observe_decode, PlacementPolicy.observe_decode),
            (type(ad).observe_prefill, AdmissionPolicy.observe_prefill),
            (type(ad).observe_decode, AdmissionPolicy.observe_decode),
        )
        return all(mine is ref for mine, ref in base)

    @property
    def _keepalive_s(self) -> float:
        """Every instance reports at least this often (half the shorter of the two
        books' ``dead_after_s``), so neither policy takes one for dead."""
        return 0.5 * min(self.placement.loads.dead_after_s, self.admission.loads.dead_after_s)

    def _observe(self, inst: PrefillInstance | DecodeInstance, now: float) -> None:
        load = inst.load(now)
        if isinstance(inst, PrefillInstance):
            self.placement.observe_prefill(load)
            self.admission.observe_prefill(load)
        else:
            self.placement.observe_decode(load)
            self.admission.observe_decode(load)

    def _report(self, inst: PrefillInstance | DecodeInstance, first: bool = True) -> None:
        """One load report of ``inst`` (its timer, like a live worker's report loop). A
        draining instance stays silent; a removed one (role switched) stops."""
        if (
            self.prefills.get(inst.name) is not inst and self.decodes.get(inst.name) is not inst
        ) or self.terminal >= len(self.requests):
            return
        if not inst.draining:
            self._observe(inst, self.loop.now())
            for hook in self.hooks:
                hook()
        interval = self.cfg.report_interval_s
        self.loop.after(
            self._phase.uniform(0.0, interval) if first else interval, self._report, inst, False
        )

    def _sample(self) -> None:
        """One point of the load time series (SLO-relative, as the paper's Fig. 6/8)."""
        now, cfg = self.loop.now(), self.cfg
        p = [i.load(now).queued_work_s / cfg.ttft_slo_s for i in self.prefills.values()]
        d = [i.load(now).step_time_s / cfg.tbt_slo_s for i in self.decodes.values()]
        self.samples.append(
            {
                "t": now,
                "prefill_load": sum(p) / len(p) if p else 0.0,
                "decode_load": sum(d) / len(d) if d else 0.0,
                "prefill": len(self.prefills),
                "decode": len(self.decodes),
                "decoding": sum(len(i) for i in self.decodes.values()),
                "done": self.terminal,
            }
        )
        if self.terminal < len(self.requests):
            self.loop.after(cfg.sample_interval_s, self._sample)

    def _arrive(self, i: int) -> None:
        if i + 1 < len(self.requests):
            self.loop.at(self.requests[i + 1].arrival, self._arrive, i + 1)
        req = self.requests[i]
        if self.cfg.dispatch_s > 0:
            self.loop.after(self.cfg.dispatch_s, self._admit, req)
        else:
            self._admit(req)

    def _admit(self, req: SimRequest) -> None:
        self.refresh()
        areq = AdmissionRequest(req.rid, req.num_tokens, max_tokens=req.output_tokens)
        decision = self.admission.decide(areq)
        if isinstance(decision, Rejection):
            self._reject(req, "admission", decision.reason)
            return
        self.admission.on_accepted(areq)
        self._place(req)

    def _place(self, req: SimRequest) -> None:
        """One placement round, as services/conductor does it: place, hand the request to
        its prefill instance; nothing is reserved until its compute starts."""
        preq = PlacementRequest(
            req.rid, req.num_tokens, tuple(req.hashes), self.cfg.block_size, arrival_ts=req.arrival
        )
        # The trace's hashes are the blocks' (checked once, when the trace was read);
        # no store is down in the simulated cluster.
        d = placement_round.place(self.placement, preq, self.cluster.index.match)
        if isinstance(d, Rejection):
            self._reject(req, "conductor", d.reason)
            return
        self._dispatch(req, d.task)

    def _dispatch(self, req: SimRequest, p: placement_round.TaskFields) -> None:
        """The placed request takes its task fields, as the prefill worker reads them
        off the PrefillTask."""
        bs, n = self.cfg.block_size, req.num_tokens
        req.source = p.source
        # What the queue expects (the conductor's PrefillTask): the reservation has the
        # last word (_granted).
        expected = plan.grant(req.source, prefill_hit=p.expected_hit_blocks, source_granted=True)
        req.cached_tokens = expected.prefix_tokens(n, bs)
        req.pulled_tokens = expected.pulled_tokens(n, bs)
        req.pull_source = req.source.node if req.source and expected.pull else ""
        req.prefill_instance, req.prefill_node = p.prefill_instance, p.prefill_node
        req.decode_instance, req.decode_node = p.decode_instance, p.decode_node
        req.want = plan.wanted(req.source)
        self.inbound[p.decode_instance] = self.inbound.get(p.decode_instance, 0) + 1
        if p.cpp_stages:
            # A pipeline's stages start at different times and perigee.sim.pipeline_gang reads the
            # prefix at push: its slots are reserved now, in one round.
            v = self._allocate(req)
            if v.step is not plan.ReservationStep.DONE:
                self._unreserve(
                    req,
                    "conductor",
                    "store capacity"
                    if v.step is plan.ReservationStep.WAIT
                    else f"store unavailable ({v.detail})",
                )
                return
            self._granted(req)
            self.pipelined.add(req.rid)
            Gang(
                req,
                [self.prefills[i] for i in p.cpp_stages],
                self.loop,
                self.cost,
                p.cpp_chunk_tokens,
                self.cluster.nodes[p.prefill_node].link,
                self._prefilled,
            ).push()
            return
        self.prefills[p.prefill_instance].push(req)

    def _reserve(self, req: SimRequest, inst: PrefillInstance) -> None:
        """``inst`` starts ``req``'s compute: take its store slots first (StoreReserver)."""
        req.reserve_until = self.loop.now() + self.cfg.reserve_wait_s
        self._reserve_round(req, inst)

    def _reserve_round(self, req: SimRequest, inst: PrefillInstance) -> None:
        v = self._allocate(req)
        if v.step is plan.ReservationStep.WAIT and self.loop.now() < req.reserve_until:
            self.loop.after(self.cfg.reserve_retry_s, self._reserve_round, req, inst)
            return
        if v.step is not plan.ReservationStep.DONE:
            why = (
                f"no room in the store after {self.cfg.reserve_wait_s:g} s ({v.detail})"
                if v.step is plan.ReservationStep.WAIT
                else f"store unavailable ({v.detail})"
            )
            self._unreserve(req, "prefill", f"kv reservation failed: {why}")
            inst.abandon(req)
            return
        self._granted(req)
        inst.compute(req)

    def _allocate(self, req: SimRequest) -> plan.ReservationVerdict:
        """One reservation round: TxAllocate what is still wanted, keep the grants."""
        todo = plan.jobs(
            prefill_node=req.prefill_node,
            decode_node=req.decode_node,
            source=req.source,
            block_hashes=req.hashes,
            num_tokens=req.num_tokens,
            block_size=self.cfg.block_size,
            roles=req.want - set(req.txs),
        )
        refused: dict[str, str] = {}
        for role, j in todo.items():
            res = self.cluster.allocate(j.node, req.rid, j.role, j.block_hashes, j.num_tokens)
            if isinstance(res, Refused):
                refused[role] = res.reason
            else:
                req.txs[role] = (j.node, res)
        v = plan.next_step(refused, {})
        if v.drop_source:  # the holder lost the prefix while the request queued
            req.want.discard(plan.SOURCE)
        return v

    def _granted(self, req: SimRequest) -> None:
        """Every slot is held: what is cached, pulled and shipped follows the grants."""
        bs, n = self.cfg.block_size, req.num_tokens
        ptx, dtx = req.txs[plan.PREFILL][1], req.txs[plan.DECODE][1]
        g = plan.grant(
            req.source,
            prefill_hit=ptx.hit_blocks if ptx is not None else 0,
            decode_hit=dtx.hit_blocks if dtx is not None else 0,
            # nowhere to pull into on a node without a store
            source_granted=plan.SOURCE in req.txs and ptx is not None,
        )
        if plan.SOURCE in req.txs and not g.keep_source:  # nothing to pull
            self.cluster.abort(*req.txs.pop(plan.SOURCE))
        req.pull_source = req.source.node if g.pull else ""
        req.pulled_tokens = g.pulled_tokens(n, bs)
        req.cached_tokens = g.prefix_tokens(n, bs)
        req.ship_tokens = g.ship_tokens(n, bs)

    def _unreserve(self, req: SimRequest, stage: str, reason: str) -> None:
        """The request fails before compute: its grants go back, its books close."""
        for node, tx in req.txs.values():
            self.cluster.abort(node, tx)
        req.txs = {}
        self.placement.release(req.rid)
        self.inbound[req.decode_instance] -= 1
        self._reject(req, stage, reason)

    def _prefilled(self, req: SimRequest, arrive: float) -> None:
        if self.decode_gate is None:  # streamed by the prefill instance, KV still on the wire
            req.first_token = req.prefill_end + self.cfg.first_token_hop_s
        self.loop.at(arrive, self._kv_landed, req)

    def _prefill_free(self, inst: PrefillInstance) -> None:
        if self.resizer is not None and self.prefills.get(inst.name) is inst:
            self.resizer.maybe_done(inst)

    def _kv_landed(self, req: SimRequest) -> None:
        """Every layer is on the decode node: the prefill instance hands the request
        over and sends FirstTokenNotice (first token at the compute's end, handoff now);
        the conductor commits the prefill and source transactions, the decode node
        commits its own when it has loaded the KV."""
        now = self.loop.now()
        dec = self.decodes[req.decode_instance]
        self.inbound[dec.name] -= 1
        self.placement.prefill_done(req.rid, req.prefill_end, handoff_ts=now)
        decode_tx = req.txs.pop("decode", None)
        for node, tx in req.txs.values():
            self.cluster.commit(node, tx)
        req.txs = {}
        if self.decode_gate is not None:
            load = dec.load(now)
            no = self.decode_gate.check(
                load.batch_size,
                load.waiting,
                load.kv_tokens,
                req.num_tokens,
                max_batch=load.max_batch,
            )
            if no is not None:
                self.placement.release(req.rid)
                if decode_tx is not None:
                    self.cluster.abort(*decode_tx)
                self._reject(req, "decode", no.reason)
                if self.resizer is not None:
                    self.resizer.maybe_done(dec)
                return
            req.first_token = now + self.cfg.first_token_hop_s
        if decode_tx is not None:
            self.cluster.commit(*decode_tx)
        dec.add(req)

    def _decoded(self, req: SimRequest) -> None:
        if self.writeback is not None:
            self.writeback.on_decoded(req)
        self.placement.release(req.rid)
        self._terminal()
        if self.resizer is not None:
            self.resizer.maybe_done(self.decodes[req.decode_instance])

    def _reject(self, req: SimRequest, stage: str, reason: str) -> None:
        req.state = "REJECTED"
        req.reject_stage, req.reject_reason = stage, reason
        forget = getattr(self.admission, "forget", None)
        if forget is not None and stage != "admission":
            forget(req.rid)  # predictive admission stops counting it
        self._terminal()

    def _terminal(self) -> None:
        self.terminal += 1
        if self._bar is not None:
            self._bar.update(1)


def simulate(
    trace: Sequence[TraceRequest],
    cfg: SimConfig | None = None,
    *,
    progress: bool = False,
    **overrides,
) -> dict:
    """Run ``trace`` through the simulator and return the summary dict (see
    :func:`perigee.sim.metrics.summarize`). ``overrides`` replace fields of ``cfg``."""
    from perigee.sim.metrics import summarize

    cfg = replace(cfg or SimConfig(), **overrides)
    return summarize(Simulator(trace, cfg, progress=progress).run())


def simulate_slice(
    trace: Sequence[TraceRequest],
    *,
    speedup: float = 1.0,
    block_size: int = TRACE_BLOCK,
    prefill: int = 1,
    decode: int = 1,
    speed: float = 1.0,
    cost: CostModel | None = None,
    **kw,
) -> dict:
    """The simulator's side of a live-vs-simulated comparison (issue 5 item 9): replay
    ``trace`` as ``perigee replay --speedup speed --block-tokens block_size`` would
    against a ``perigee.stack`` of ``prefill`` + ``decode`` workers whose mock engines
    run ``cost`` (default: the analytic LLaMA3-70B model) at ``speedup``. Each trace hash
    id is one block of ``block_size`` tokens, prompt lengths scaled the way
    :class:`perigee.trace.PromptBuilder` scales them.

    What the live stack does beyond the cost model is modelled with its defaults:
    workers report load every ``defaults.REPORT_INTERVAL_S`` (0.1 s) on their own
    timers, the conductor keeps a dispatch until a report ``defaults.REPORT_GRACE_S``
    newer covers it (services.common.defaults: the stack's and the conductor's own
    defaults, so the simulator imports neither), and the control plane's latencies
    are :data:`LIVE_DISPATCH_S`, :data:`LIVE_FIRST_TOKEN_HOP_S` and
    :data:`LIVE_PREFILL_HANDOFF_S`. ``kw`` sets any :class:`SimConfig` field
    (cache_tokens_per_node, policy, admission, max_batch, output_scale, max_output,
    report_interval_s, dispatch_s, ...), these included. Returns the summary dict
    (``cache_hit_rate``, ``ttft_s`` {mean, p50, p90, p99}, ...)."""
    base = cost or CostModel()
    live = {
        "report_interval_s": defaults.REPORT_INTERVAL_S,
        "dispatch_s": LIVE_DISPATCH_S,
        "first_token_hop_s": LIVE_FIRST_TOKEN_HOP_S,
        "prefill_handoff_s": LIVE_PREFILL_HANDOFF_S,
    }
    placement_kw = {"report_grace_s": defaults.REPORT_GRACE_S, **kw.pop("placement_kw", {})}
    cfg = SimConfig(
        prefill=prefill,
        decode=decode,
        block_size=block_size,
        speed=speed,
        cost=base.with_speedup(speedup),
        placement_kw=placement_kw,
        **{**live, **kw},
    )
    return simulate(trace, cfg)
