"""Conductor service: places each admitted request on a (prefill, decode) pair with the
KVCache-centric policy (paper Algorithm 1) and drives the stores' transactions.

A request's lifecycle here (``pending`` holds it from DISPATCHED to the end):

    SCHEDULE_QUEUE (JetStream work queue shared by the conductors; acked after
    DISPATCHED, so a conductor that dies holding it has it go to another: the request
    is claimed by id before dispatch and a later delivery re-sends the claimed placement,
    services.common.intake_queue) or SCHEDULE (core NATS, queue group Q_CONDUCTOR)
      -> PLACING      policy.place over the shadow index (shadow.py) and load reports
      -> DISPATCHED   PrefillTask on prefill_tasks(instance) naming both instances and
                      the expected prefix; Accepted to the client. The prefill instance
                      opens the store transactions when its compute starts and renews
                      their leases (services.prefill.reserve); to an idle instance the
                      first round goes from here, right after the task, the stores
                      answering the instance (services.prefill.reserve_ahead)
      -> COMMITTED    FirstTokenNotice (prefill, once its KV is on the decode node):
                      TxCommit on the SOURCE tx it names, and on the prefill store
                      unless that committed it with the last ship (prefill_committed)
       | ABORTED      RequestFailed: the worker aborted its transactions; TxAbort again
                      on the named prefill tx (harmless when already gone)
       | FORGOTTEN    no notice for ``forget_after_s``: dropped from the policy's books

Rejections from the policy go to the client as Error 429 (with retry_after_s) or 503.
A migrated request (``GenerateRequest.migration``: the gateway resent it after its
worker died) is placed by the same policy without SLO rejection and away from the dead
instance (services.conductor.migrated_placement); the dead attempt's books are dropped.
Load reports (load.prefill.*, load.decode.*) feed the policy and liveness; the shadow
view follows KV events and store announces. Nothing here is durable: a restarted
conductor rebuilds its view from the KV-event stream (dumping a store only where the
stream falls short; services.conductor.shadow) and commits by the ids in the notices,
so several conductors can serve one queue group against the same stores (§5.3). A
node whose store went silent is left out of placement until it is back.

Role switches and the dynamic P/D ratio controller (``pd_controller``): roles.py.
With ``adaptive_threshold`` the policy tunes its kvcache_balancing_threshold from the
first-token notices (services.conductor.balancing).
"""

import asyncio
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

import msgspec
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg as NatsMsg
from structlog.contextvars import bound_contextvars

from bus_schemas import subjects
from bus_schemas.codec import BadMessage, decode, encode
from bus_schemas.load import DecodeLoad, PrefillLoad
from bus_schemas.placement import (
    ConductorEvent,
    FirstTokenNotice,
    PrefillTask,
    RequestFailed,
)
from bus_schemas.requests import Accepted, ErrorCode, GenerateRequest
from services.common import bus, defaults, intake, intake_queue, metrics, presence, reservation
from services.common.calibration import CalibrationBook
from services.common.clock import UnixClock
from services.common.cost_fit import load_cost_model
from services.common.cost_model import CostModel
from services.common.defaults import TX_LEASE_S
from services.common.pools_heard import PoolsHeard
from services.common.store_tx import StoreTx
from services.conductor import placement_round
from services.conductor.balancing import AdaptiveThreshold
from services.conductor.pd_ratio import PDRatioController
from services.conductor.placement_policy import PlacementPolicy, Rejection, TtftFeedback
from services.conductor.role_control import RoleControl
from services.conductor.shadow import ShadowView
from services.policy import chunk_timing as cpp_
from services.policy.retry_schedule import RetrySchedule
from tracing import tracer

log = structlog.get_logger()

# An instance silent this long leaves the books (its name may never come back).
FORGET_INSTANCE_S = 600.0


# A placement on an instance whose predicted queue is at most this long has its store
# round trip sent ahead of the task (ConductorConfig.reserve_ahead_queue_s).
RESERVE_AHEAD_QUEUE_S = 0.05


@dataclass(frozen=True)
class ConductorConfig:
    """The conductor service's settings: SLOs, placement strategy, timeouts and controllers."""

    conductor_id: str = "conductor-0"
    block_size: int = defaults.BLOCK_SIZE
    ttft_slo_s: float = defaults.TTFT_SLO_S
    tbt_slo_s: float = defaults.TBT_SLO_S
    balancing_threshold: float = 2.0
    speedup: float = 1.0
    dead_after_s: float = defaults.DEAD_AFTER_S
    strategy: str = "global"
    tx_timeout_s: float = 2.0
    discover_window_s: float = 0.5
    store_dead_after_s: float = 5.0
    sweep_interval_s: float = 1.0
    report_grace_s: float = defaults.REPORT_GRACE_S  # see PlacementPolicy.report_grace_s
    cost_model: str = ""  # a fitted cost model (perigee profile --json); "": analytic
    adaptive_threshold: bool = False  # tune balancing_threshold online (from its value)
    ttft_feedback: bool = True  # scale TTFT predictions by each instance's observed ratio
    ttft_margin: float = 0.9  # plan placements to this share of the TTFT SLO (p90, not mean)
    serve_when_idle: bool = True  # an idle instance takes any request (PlacementPolicy)
    # A request told to come back keeps the room it was promised (RetrySchedule.reserve);
    # off where the clients never retry (the simulator's).
    reserve_retries: bool = True
    tbt_check: bool = True  # False: no TBT rejection at placement (baseline admission)
    pd_controller: bool = False  # publish the dynamic P/D ratio's role switches
    pd_interval_s: float = 10.0
    pd_window_s: float = 60.0
    pd_cooldown_s: float = 30.0
    pd_min_samples: int = 10
    # Serve the crash-safe intake (SCHEDULE_QUEUE, services.common.intake_queue); a
    # message held longer than intake_ack_wait_s by a conductor that died goes to another.
    durable_intake: bool = False
    intake_ack_wait_s: float = intake_queue.ACK_WAIT_S
    # Past this, a placement whose claim the PLACED stream did not store goes out
    # unclaimed (the stream is electing a leader) rather than wait 4-9 s (0: wait).
    intake_patience_s: float = intake_queue.PATIENCE_S
    # At start, wait up to this long for a load report from each pool before placing
    # (services.common.pools_heard).
    pools_wait_s: float = 2.0
    # Chunked pipeline parallelism (services.policy.chunk_timing): groups of this many prefill
    # instances (1: none), their chunk size and the computed tokens a group needs.
    cpp_group: int = 1
    cpp_chunk_tokens: int = cpp_.DEFAULT_CHUNK_TOKENS
    cpp_min_tokens: int = cpp_.DEFAULT_MIN_TOKENS
    # Send a placement's first round of TxAllocates ahead of its task, the stores
    # answering the prefill instance, when the instance's predicted queue is at most
    # this long (services.prefill.reserve_ahead); negative: never.
    reserve_ahead_queue_s: float = RESERVE_AHEAD_QUEUE_S

    @property
    def forget_after_s(self) -> float:
        """A placed request no worker has settled by then is dropped from the books
        (its prefill instance died, or the notice was lost)."""
        return 4 * self.ttft_slo_s + 30.0


class ConductorService:
    """The NATS adapter of placement: places admitted requests and drives their transactions."""

    def __init__(
        self, nc: NATS, cfg: ConductorConfig, clock=None, cost: CostModel | None = None
    ) -> None:
        self.nc = nc
        self.cfg = cfg
        self.clock = clock or UnixClock()
        self.cost = cost or load_cost_model(cfg.cost_model, cfg.speedup)
        # Each instance's own fit, from its load reports; a hand-given model is fixed.
        self.book = CalibrationBook(self.cost, fixed=bool(cfg.cost_model))
        adaptive = None
        if cfg.adaptive_threshold:
            adaptive = AdaptiveThreshold(
                self.clock, initial=cfg.balancing_threshold, hi=max(16.0, cfg.balancing_threshold)
            )
        pd = None
        if cfg.pd_controller:
            pd = PDRatioController(
                self.clock,
                window_s=cfg.pd_window_s,
                cooldown_s=cfg.pd_cooldown_s,
                min_samples=cfg.pd_min_samples,
                book=self.book,
            )
        self.policy = PlacementPolicy(
            self.clock,
            self.cost,
            ttft_slo_s=cfg.ttft_slo_s,
            tbt_slo_s=cfg.tbt_slo_s,
            balancing_threshold=cfg.balancing_threshold,
            strategy=cfg.strategy,
            dead_after_s=cfg.dead_after_s,
            report_grace_s=cfg.report_grace_s,
            adaptive=adaptive,
            tbt_check=cfg.tbt_check,
            book=self.book,
            # A hand-given cost model is taken as it is: no per-instance correction.
            feedback=TtftFeedback() if cfg.ttft_feedback and not cfg.cost_model else None,
            ttft_margin=cfg.ttft_margin,
            serve_when_idle=cfg.serve_when_idle,
            cpp=cpp_.CppConfig(cfg.cpp_group, cfg.cpp_chunk_tokens, cfg.cpp_min_tokens),
            retries=RetrySchedule(reserve=cfg.reserve_retries),
        )
        self.roles = RoleControl(
            nc,
            self.policy,
            pd,
            ttft_slo_s=cfg.ttft_slo_s,
            tbt_slo_s=cfg.tbt_slo_s,
            interval_s=cfg.pd_interval_s,
        )
        self.subs = bus.Subscriptions(nc)
        self.heard = PoolsHeard(self.policy.live_prefill, self.policy.live_decode)
        self.intake: intake_queue.QueueConsumer | None = None
        self.shadow = ShadowView(
            nc,
            self.subs,
            self.clock,
            store_dead_after_s=cfg.store_dead_after_s,
            request_timeout_s=cfg.tx_timeout_s,
        )
        self.tx = StoreTx(nc, timeout_s=cfg.tx_timeout_s)
        self.pending: dict[str, float] = {}  # request id -> placed at, until a notice settles it
        self.js = nc.jetstream() if nc is not None else None
        self.resent = 0  # placements re-sent from a claim (a redelivery): none placed twice
        # Requests placed here without a claim (the core path, or a claim the PLACED
        # stream could not store in time): a stored copy delivered later is dropped.
        self._unclaimed: OrderedDict[str, None] = OrderedDict()

    async def start(self) -> None:
        s = self.subs
        await s.serve(
            subjects.LOAD_PREFILL_ALL,
            PrefillLoad,
            self._on_prefill_load,
            span_name="conductor.load",
        )
        await s.serve(
            subjects.LOAD_DECODE_ALL, DecodeLoad, self._on_decode_load, span_name="conductor.load"
        )
        await self.roles.start(s)
        await self.shadow.start(self.cfg.discover_window_s)  # discovery runs in the background
        await self.heard.wait(self.cfg.pools_wait_s)
        await s.serve(
            subjects.SCHEDULE,
            GenerateRequest,
            self._on_schedule,
            queue=subjects.Q_CONDUCTOR,
            concurrent=True,
            span_name="conductor.schedule",
            on_bad=self._on_bad_request,
        )
        if self.cfg.durable_intake:
            await intake_queue.ensure_streams(
                self.js, [intake_queue.SCHEDULE_STREAM, intake_queue.PLACED_STREAM]
            )
            self.intake = intake_queue.QueueConsumer(
                self.nc,
                intake_queue.SCHEDULE_STREAM,
                subjects.SCHEDULE_QUEUE,
                subjects.Q_CONDUCTOR,
                self._on_queued,
                concurrent=True,
                ack_wait_s=self.cfg.intake_ack_wait_s,
            )
            await self.intake.start(s)
        # Last, the bare subject: nothing is sent here before this conductor places a
        # request, and a reply to a probe on it (perigee.stack) proves every other
        # subscription is live.
        cid = self.cfg.conductor_id
        for subject in (
            subjects.conductor_events_from_workers(cid),
            subjects.conductor_events(cid),
        ):
            await s.serve(
                subject,
                ConductorEvent,
                self._on_event,
                concurrent=True,
                span_name="conductor.event",
            )
        s.spawn(self._sweeper(), name="conductor:sweeper")
        s.spawn(
            presence.beat(self.nc, "conductor", cid, self.cfg.dead_after_s),
            name="conductor:presence",
        )
        await bus.sync(self.nc)  # subscriptions are live on the server once start() returns
        log.info("conductor_started", id=self.cfg.conductor_id, strategy=self.cfg.strategy)

    async def stop(self) -> None:
        if self.intake is not None:
            await self.intake.close()
        await self.subs.close()

    # ------------------------------------------------------------ loads

    async def _on_prefill_load(self, load: PrefillLoad, m: NatsMsg) -> None:
        if not subjects.named_by(m.subject, load.instance):
            log.warning("load_report_impostor", subject=m.subject, claimed=load.instance)
            return
        self.policy.observe_prefill(load)
        self.roles.observe_prefill(load)
        self.heard.check()

    async def _on_decode_load(self, load: DecodeLoad, m: NatsMsg) -> None:
        if not subjects.named_by(m.subject, load.instance):
            log.warning("load_report_impostor", subject=m.subject, claimed=load.instance)
            return
        self.policy.observe_decode(load)
        self.roles.observe_decode(load)
        self.heard.check()

    # ------------------------------------------------------------ placement

    async def _on_bad_request(self, m: NatsMsg, err: BadMessage) -> None:
        await intake.answer_malformed(self.nc, "conductor", m, err, durable=False)

    async def _on_queued(self, m: NatsMsg) -> None:
        """A request off the crash-safe intake: placed (or its claimed placement re-sent)
        and acked only then, so a conductor that dies before the ack loses nothing."""
        await intake.consume_durable(
            self.nc, "conductor", "conductor.schedule", m, self._on_schedule
        )

    async def _on_schedule(self, req: GenerateRequest, m: NatsMsg, durable: bool = False) -> None:
        reply = intake.reply_for(req, m, durable)
        with bound_contextvars(request_id=req.request_id):
            if not reply:
                log.warning("no_reply_subject_dropped")
                return
            if not req.prompt_token_ids:
                await self._error(req.request_id, reply, ErrorCode.BAD_REQUEST, "empty prompt")
                return
            if durable and req.request_id in self._unclaimed:
                log.warning("placed_unclaimed_before_dropped")
                return
            if durable and intake_queue.redelivered(m):
                stored = await intake_queue.claimed(self.js, req.request_id)
                if stored is not None:  # placed before: send that placement again
                    await self._resend(decode(stored, PrefillTask), reply)
                    return
            try:
                await self.schedule(req, reply, claim=durable)
            except Exception as e:  # noqa: BLE001 - the client must hear about it
                log.exception("placement_failed")
                self.policy.release(req.request_id)
                await self._error(
                    req.request_id,
                    reply,
                    ErrorCode.INTERNAL,
                    f"placement failed: {type(e).__name__}",
                )

    async def schedule(self, req: GenerateRequest, reply: str, claim: bool = False) -> None:
        bs = self.cfg.block_size
        preq = placement_round.request_for(req, bs)  # hashes as admission checked them
        req = _with(req, block_hashes=list(preq.block_hashes), block_size=bs, reply_subject=reply)
        if (
            req.migration is not None
        ):  # a dead worker's request: services.conductor.migrated_placement
            metrics.MIGRATIONS.labels(reason=req.migration.reason).inc()
            # The dead attempt's books (a prefill death leaves it unsettled) go now.
            self.pending.pop(req.migration.dead_request_id, None)
            self.policy.release(req.migration.dead_request_id)
            log.info(
                "migration",
                attempt=req.migration.attempt,
                reason=req.migration.reason,
                dead=req.migration.dead_instance,
                of=req.migration.of_request_id,
            )
        with tracer().start_as_current_span("conductor.place") as span:
            span.set_attribute("request_id", req.request_id)
            span.set_attribute("prompt_tokens", preq.num_tokens)
            span.set_attribute("strategy", self.cfg.strategy)
            # A dead store takes its node's instances out (services.conductor.migrated_placement).
            decision = placement_round.place(
                self.policy,
                preq,
                self.shadow.match,
                down=self.shadow.down(),
                migration=req.migration,
            )
            if isinstance(decision, Rejection):
                span.set_attribute("outcome", f"rejected_{int(decision.code)}")
                span.set_attribute("reason", decision.reason)
                log.info("rejected", code=int(decision.code), reason=decision.reason)
                await self._error(
                    req.request_id, reply, decision.code, decision.reason, decision.retry_after_s
                )
                return
            await self._dispatch(req, reply, decision, span, claim)

    async def _dispatch(
        self,
        req: GenerateRequest,
        reply: str,
        placed: placement_round.Placed,
        span,
        claim: bool = False,
    ) -> None:
        """Hand the placement to the prefill instance; it reserves the store slots when
        its compute starts, so nothing is held while the request waits in its queue."""
        bs = self.cfg.block_size
        p, f = placed.placement, placed.task
        r = p.remote
        # An idle instance starts at once: its stores' round trip need not wait for the
        # task to arrive (a pipeline's stages reserve their own way).
        ahead = (
            uuid.uuid4().hex[:16]
            if p.est_queue_s <= self.cfg.reserve_ahead_queue_s and not f.cpp_stages
            else ""
        )
        task = PrefillTask(
            request=req,
            conductor_id=self.cfg.conductor_id,
            prefill_instance=f.prefill_instance,
            decode_instance=f.decode_instance,
            prefill_node=f.prefill_node,
            decode_node=f.decode_node,
            expected_hit_blocks=f.expected_hit_blocks,
            source=f.source,
            placed_ts=time.time(),
            est_ttft_s=f.est_ttft_s,
            # The baseline (no TBT check here) may still reject at decode, after prefill:
            # then the first token must wait for decode to take the request.
            stream_first_token=self.cfg.tbt_check,
            cpp_stages=list(f.cpp_stages),
            cpp_chunk_tokens=f.cpp_chunk_tokens,
            prefill_incarnation=f.prefill_incarnation,
            decode_incarnation=f.decode_incarnation,
            reserved_ahead=ahead,
        )
        if claim:
            try:
                held, ours = await intake_queue.claim(
                    self.js,
                    req.request_id,
                    encode(task),
                    timeout=self.cfg.intake_patience_s or 30.0,
                )
            except intake_queue.STALLED as e:  # no leader: place unclaimed
                if not self.cfg.intake_patience_s:
                    raise
                metrics.INTAKE_BYPASSES.labels(hop="conductor").inc()
                log.warning("claim_stalled_placed_unclaimed", error=f"{type(e).__name__}: {e}")
                held, ours, claim = b"", True, False
            if not ours:  # another delivery of this id placed it first: that placement stands
                self.policy.release(req.request_id)
                span.set_attribute("outcome", "claimed_before")
                await self._resend(decode(held, PrefillTask), reply)
                return
        if not claim:
            self._unclaimed[req.request_id] = None
            while len(self._unclaimed) > intake_queue.REMEMBER_UNCLAIMED:
                self._unclaimed.popitem(last=False)
        self.pending[req.request_id] = self.clock.now()
        for k, v in {
            "outcome": "placed",
            "prefill_instance": p.prefill_instance,
            "decode_instance": p.decode_instance,
            "predicted_prefix_tokens": p.prefix_tokens,
            "remote_source": r.node if r else "",
            "remote_blocks": r.num_blocks if r else 0,
            "est_ttft_s": p.est_ttft_s,
            "est_queue_s": p.est_queue_s,
            "est_transfer_s": p.est_transfer_s,
            "est_tbt_s": p.est_tbt_s,
        }.items():
            span.set_attribute(k, v)
        log.info(
            "placed",
            prefill=p.prefill_instance,
            decode=p.decode_instance,
            prefix_tokens=p.prefix_tokens,
            remote=r.node if r else None,
            est_ttft_s=round(p.est_ttft_s, 6),
            cpp_stages=list(p.cpp_stages) or None,
        )
        # nats.py writes these together once this task yields, right after: the log
        # line above is not on the first token's way.
        await bus.publish(self.nc, subjects.prefill_tasks(p.prefill_instance), task)
        if ahead:
            await self._reserve_ahead(task)
        await bus.publish(self.nc, reply, accepted(task, bs))

    async def _reserve_ahead(self, task: PrefillTask) -> None:
        """The task's first round of TxAllocates, answered to its prefill instance
        (services.prefill.reserve_ahead); a send that fails leaves the round to the
        instance (it waits, then asks itself)."""
        roles = reservation.wanted(task.source)
        for role, (node, msg) in reservation.allocations(task, roles, TX_LEASE_S).items():
            reply = subjects.prefill_reserved(task.prefill_instance, task.reserved_ahead, role)
            try:
                await bus.publish(
                    self.nc, subjects.store_ctl(node, "tx.allocate"), msg, reply=reply
                )
            except Exception as e:  # noqa: BLE001 - the instance allocates it itself
                log.warning("reserve_ahead_unsent", node=node, role=role, error=repr(e))

    async def _resend(self, task: PrefillTask, reply: str) -> None:
        """Send a claimed placement again, as it was decided: its prefill instance drops
        it if the first send got there, and the client may see Accepted twice."""
        self.resent += 1
        metrics.INTAKE_RESENT.inc()
        log.warning(
            "placement_resent",
            prefill=task.prefill_instance,
            decode=task.decode_instance,
            placed_by=task.conductor_id,
        )
        # No round goes ahead of it again: the instance reserves its own at once.
        again = msgspec.structs.replace(task, reserved_ahead="")
        await bus.publish(self.nc, subjects.prefill_tasks(task.prefill_instance), again)
        await bus.publish(self.nc, reply, accepted(task, self.cfg.block_size))

    # ------------------------------------------------------------ commit / abort

    def _sender_node(self, m: NatsMsg | None) -> str | None:
        """The node of the worker whose subject ``m`` came on (its last load report);
        None for the bare subject (the admin's), "" for a worker never heard of."""
        if m is None or not m.subject.startswith(
            subjects.conductor_events(self.cfg.conductor_id) + "."
        ):
            return None
        sender = m.subject.rsplit(".", 1)[-1]
        ld = self.policy.loads.prefill.get(sender) or self.policy.loads.decode.get(sender)
        return ld.node if ld is not None else ""

    async def _on_event(self, ev: ConductorEvent, m: NatsMsg | None) -> None:
        """Settle by the ids in the notice (a conductor restarted since the placement
        can do it too); the worker that opened the transactions aborts its own on failure,
        this abort only covers a worker that could not. The transactions a notice names
        are committed or aborted only for a worker on their node (the subject names the
        sender, its load reports its node): another worker's notice settles the books of
        the request, never another node's transactions."""
        with bound_contextvars(request_id=ev.request_id):
            node = self._sender_node(m)
            owner = node is None or node == ev.prefill_node
            if not owner:
                log.warning("notice_not_from_the_tx_node", sender_node=node, node=ev.prefill_node)
            self.pending.pop(ev.request_id, None)
            prefill = (ev.prefill_node, ev.prefill_tx_id)
            if isinstance(ev, FirstTokenNotice):
                source = [(ev.source_node, ev.source_tx_id)] if ev.source_tx_id else []
                before = self.policy.threshold()
                self.policy.prefill_done(ev.request_id, ev.ts, ev.handoff_ts or None)
                if self.policy.threshold() != before:
                    log.info("balancing_threshold", old=before, new=self.policy.threshold())
                if not owner:
                    return
                # Unanswered: a refusal is the store's to log, and a lost commit only
                # leaves the blocks uncached when the lease ends; nothing here would act.
                for n, t in source if ev.prefill_committed else [prefill, *source]:
                    await self.tx.commit_unanswered(n, t, ev.request_id)
                if source:  # hot-spot migration: the prefill node now holds a replica
                    log.info("replica_committed", node=prefill[0], source=source[0][0])
            elif isinstance(ev, RequestFailed):
                self.policy.release(ev.request_id)
                log.info("request_failed", reason=ev.reason)
                # A decode failure's prefill tx is committed already (at the hand-off):
                # only the prefill node's own worker has one to abort.
                if ev.prefill_tx_id and owner:
                    await self.tx.abort(*prefill, ev.request_id, ev.reason)

    async def _error(
        self,
        request_id: str,
        reply: str,
        code: ErrorCode,
        message: str,
        retry_after_s: float | None = None,
    ) -> None:
        await bus.send_error(self.nc, "conductor", request_id, reply, code, message, retry_after_s)

    # ------------------------------------------------------------ housekeeping

    async def _sweeper(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.sweep_interval_s)
            self.sweep()

    def sweep(self) -> None:
        """Forget requests no worker settled (its instance died) and dead stores."""
        self.policy.prune(FORGET_INSTANCE_S)
        for name, size in (
            ("pending", len(self.pending)),
            ("unclaimed", len(self._unclaimed)),
            ("instances", len(self.policy.loads.prefill) + len(self.policy.loads.decode)),
        ):
            metrics.STATE_ENTRIES.labels(map=name).set(size)
        horizon = self.clock.now() - self.cfg.forget_after_s
        for rid in [r for r, placed_at in self.pending.items() if placed_at < horizon]:
            del self.pending[rid]
            self.policy.release(rid)
            log.warning("pending_expired", request_id=rid)
        self.shadow.sweep()


def accepted(task: PrefillTask, block_size: int) -> Accepted:
    """The Accepted of a placement (its cached prefix: local or remote)."""
    req, src = task.request, task.source
    blocks = src.first_block + src.num_blocks if src else task.expected_hit_blocks
    return Accepted(
        request_id=req.request_id,
        prefill_instance=task.prefill_instance,
        decode_instance=task.decode_instance,
        cached_tokens=min(blocks * block_size, len(req.prompt_token_ids)),
        prefill_incarnation=task.prefill_incarnation,
        decode_incarnation=task.decode_incarnation,
        est_ttft_s=task.est_ttft_s,
    )


def _with(req: GenerateRequest, **changes) -> GenerateRequest:
    return msgspec.structs.replace(req, **changes)
