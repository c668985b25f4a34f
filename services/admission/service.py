"""Admission service: the first hop after the gateway.

A request's lifecycle here (no queue is kept; each message is decided on arrival):

    INTAKE (JetStream work queue, the gateway's requests; acked once decided and
    forwarded or answered) or REQUESTS (core NATS, queue group Q_ADMISSION: bus clients)
      -> VALIDATED   strict decode (malformed: Error 400 on the reply subject), reply
                     subject = NATS reply or request.reply_subject (none: logged, dropped),
                     non-empty prompt, block hashes filled (services.common.hashing) or
                     checked, arrival_ts stamped
      -> DECIDED     the admission policy over the latest load reports
      -> FORWARDED   the filled request on the SCHEDULE_QUEUE work queue for the
                     conductors, stored there once by its id (the stream's ack is the
                     acceptance). A migration (``GenerateRequest.migration``) skips the
                     decision: it was accepted; so does an INTAKE message redelivered
                     after an admission died holding it, which may have been accepted
                     (services.common.intake_queue)
       | REJECTED    Error 429 (retry_after_s) or 503 on the reply subject

Load reports (load.prefill.*, load.decode.*) feed the policy and its liveness view; a
RoleSwitch (perigee.ctl.role) drops the switched instance's report in its old role at
once, so its last load there does not count until the liveness window runs out.
"""

import time
from collections import OrderedDict
from dataclasses import dataclass

import msgspec
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg as NatsMsg
from opentelemetry import trace
from structlog.contextvars import bound_contextvars

from bus_schemas import subjects
from bus_schemas.codec import BadMessage, encode
from bus_schemas.control import RoleSwitch
from bus_schemas.load import DecodeLoad, PrefillLoad
from bus_schemas.requests import ErrorCode, GenerateRequest
from services.admission.admission_policy import (
    AdmissionPolicy,
    AdmissionRequest,
    make_admission_policy,
)
from services.common import bus, defaults, intake, intake_queue, metrics, presence
from services.common.calibration import CalibrationBook
from services.common.clock import Clock, WallClock
from services.common.cost_fit import load_cost_model
from services.common.cost_model import CostModel
from services.common.intake import hashes_for
from services.common.pools_heard import PoolsHeard
from services.common.rejection import Rejection
from tracing import inject

log = structlog.get_logger()

REMEMBER_DECIDED = 100_000


@dataclass(frozen=True)
class AdmissionConfig:
    """The admission service's settings: SLOs, policy mode, cost model and intake."""

    block_size: int = defaults.BLOCK_SIZE
    ttft_slo_s: float = defaults.TTFT_SLO_S
    tbt_slo_s: float = defaults.TBT_SLO_S
    speedup: float = 1.0
    policy: str = "early"
    admission_id: str = "admission"  # unique among admissions: its presence beats' name
    dead_after_s: float = defaults.DEAD_AFTER_S
    cost_model: str = ""  # a fitted cost model (perigee profile --json); "": analytic
    decode_time_s: float = 5.0  # predict: the uniform decode time t_d
    # Serve the gateway's INTAKE work queue and forward on SCHEDULE_QUEUE (False: core
    # NATS REQUESTS -> SCHEDULE only, for a bus without JetStream).
    durable_intake: bool = False
    intake_ack_wait_s: float = intake_queue.ACK_WAIT_S
    # Past this, a forward the work queue did not store goes on core SCHEDULE (0: wait).
    intake_patience_s: float = intake_queue.PATIENCE_S
    # At start, wait up to this long for a load report from each pool before taking
    # requests (services.common.pools_heard).
    pools_wait_s: float = 2.0


class AdmissionService:
    """The NATS adapter of admission: decodes requests, asks the policy, forwards or rejects."""

    def __init__(
        self,
        nc: NATS,
        cfg: AdmissionConfig,
        clock: Clock | None = None,
        cost: CostModel | None = None,
        policy: AdmissionPolicy | None = None,
    ) -> None:
        self.nc = nc
        self.cfg = cfg
        self.clock = clock or WallClock()
        extra = {"decode_time_s": cfg.decode_time_s} if cfg.policy == "predict" else {}
        cost = cost or load_cost_model(cfg.cost_model, cfg.speedup)
        self.policy = policy or make_admission_policy(
            cfg.policy,
            self.clock,
            cost,
            # Each instance's own fit, from its load reports; a hand-given model is fixed.
            book=CalibrationBook(cost, fixed=bool(cfg.cost_model)),
            ttft_slo_s=cfg.ttft_slo_s,
            tbt_slo_s=cfg.tbt_slo_s,
            dead_after_s=cfg.dead_after_s,
            **extra,
        )
        self.subs = bus.Subscriptions(nc)
        self.heard = PoolsHeard(self.policy.live_prefill, self.policy.live_decode)
        self.intake: intake_queue.QueueConsumer | None = None
        self._decided: OrderedDict[str, bool] = OrderedDict()  # request id -> accepted
        self.bypasses = 0  # forwards sent on core SCHEDULE because the work queue stalled
        self.js = nc.jetstream() if nc is not None else None

    async def start(self) -> None:
        s = self.subs
        await s.serve(
            subjects.LOAD_PREFILL_ALL,
            PrefillLoad,
            self._on_prefill_load,
            span_name="admission.load",
        )
        await s.serve(
            subjects.LOAD_DECODE_ALL, DecodeLoad, self._on_decode_load, span_name="admission.load"
        )
        await s.serve(
            subjects.CTL_ROLE, RoleSwitch, self._on_role_switch, span_name="admission.role_switch"
        )
        await self.heard.wait(self.cfg.pools_wait_s)
        await s.serve(
            subjects.REQUESTS,
            GenerateRequest,
            self._on_request,
            queue=subjects.Q_ADMISSION,
            span_name="admission.request",
            on_bad=self._on_bad,
        )
        if self.cfg.durable_intake:
            await intake_queue.ensure_streams(
                self.js, [intake_queue.SCHEDULE_STREAM, intake_queue.INTAKE_STREAM]
            )
            self.intake = intake_queue.QueueConsumer(
                self.nc,
                intake_queue.INTAKE_STREAM,
                subjects.INTAKE,
                subjects.Q_ADMISSION,
                self._on_intake,
                ack_wait_s=self.cfg.intake_ack_wait_s,
                # Decided one at a time: few held at once, each well within the ack wait
                # (one held past it would come again, as if its admission had died).
                max_inflight=64,
            )
            await self.intake.start(s)
        s.spawn(
            presence.beat(self.nc, "admission", self.cfg.admission_id, self.cfg.dead_after_s),
            name="admission:presence",
        )
        await bus.sync(self.nc)  # subscriptions are live on the server once start() returns
        log.info("admission_started", policy=self.cfg.policy, id=self.cfg.admission_id)

    async def stop(self) -> None:
        if self.intake is not None:
            await self.intake.close()
        await self.subs.close()

    async def _on_prefill_load(self, load: PrefillLoad, m: NatsMsg) -> None:
        if not subjects.named_by(m.subject, load.instance):
            log.warning("load_report_impostor", subject=m.subject, claimed=load.instance)
            return
        self.policy.observe_prefill(load)
        self.heard.check()

    async def _on_decode_load(self, load: DecodeLoad, m: NatsMsg) -> None:
        if not subjects.named_by(m.subject, load.instance):
            log.warning("load_report_impostor", subject=m.subject, claimed=load.instance)
            return
        self.policy.observe_decode(load)
        self.heard.check()

    async def _on_role_switch(self, rs: RoleSwitch, _m: NatsMsg) -> None:
        old = rs.previous_role()
        if old is None:
            log.warning("bad_role_switch", instance=rs.instance, role=rs.role)
            return
        self.policy.forget_instance(old, rs.instance)
        log.info("role_switch_seen", instance=rs.instance, role=rs.role)

    async def _on_bad(self, m: NatsMsg, err: BadMessage) -> None:
        await intake.answer_malformed(self.nc, "admission", m, err, durable=False)

    async def _on_intake(self, m: NatsMsg) -> None:
        """A request off the gateway's work queue: acked once it is forwarded or
        answered, so one an admission dies holding comes again."""
        await intake.consume_durable(self.nc, "admission", "admission.request", m, self._on_request)

    async def _on_request(self, req: GenerateRequest, m: NatsMsg, durable: bool = False) -> None:
        reply = intake.reply_for(req, m, durable)
        with bound_contextvars(request_id=req.request_id):
            if not reply:
                log.warning("no_reply_subject_dropped")
                return
            span = trace.get_current_span()
            span.set_attribute("request_id", req.request_id)
            filled, problem = self.fill(req, reply)
            if problem:
                span.set_attribute("admission.decision", "bad_request")
                await self._error(req.request_id, reply, ErrorCode.BAD_REQUEST, problem)
                return
            if req.migration is not None:
                # A dead worker's request resent by the gateway: it was accepted once and
                # what is accepted is served, so no early rejection.
                span.set_attribute("admission.decision", "migration")
                await self._forward(filled)
                return
            if durable and intake_queue.redelivered(m):
                if self._decided.get(req.request_id) is False:
                    return  # rejected here, its ack lost: the client has its answer
                # Decided by an admission that died holding it, maybe accepted and
                # forwarded: accepted then (the forward dedups on the id).
                span.set_attribute("admission.decision", "redelivered")
                log.info("redelivered_forwarded")
                await self._forward(filled)
                return
            areq = AdmissionRequest(
                request_id=req.request_id,
                num_tokens=len(req.prompt_token_ids),
                max_tokens=req.sampling.max_tokens,
                ttft_slo_s=req.ttft_slo_s,
                tbt_slo_s=req.tbt_slo_s,
                seqs=req.sampling.n,
            )
            decision = self.policy.decide(areq)
            if isinstance(decision, Rejection):
                span.set_attribute("admission.decision", f"reject_{int(decision.code)}")
                log.info("rejected", code=int(decision.code), reason=decision.reason)
                self._remember(req.request_id, False)
                await self._error(
                    req.request_id, reply, decision.code, decision.reason, decision.retry_after_s
                )
                return
            span.set_attribute("admission.decision", "accept")
            self.policy.on_accepted(areq)
            metrics.ADMITTED.inc()
            self._remember(req.request_id, True)
            await self._forward(filled)

    def _remember(self, request_id: str, accepted: bool) -> None:
        """What this admission decided, for a redelivery of the same id (its ack lost,
        or held past the ack wait): answered once, never decided the other way."""
        self._decided[request_id] = accepted
        while len(self._decided) > REMEMBER_DECIDED:
            self._decided.popitem(last=False)

    async def _forward(self, req: GenerateRequest) -> None:
        """Store the request on the conductors' work queue, once by its id; accepted once
        the stream acks it. (Without the durable intake, or for a request the gateway
        sent on the core path: core SCHEDULE, at most once.)

        A work queue that has not stored it within ``intake_patience_s`` is electing a
        leader (a nats-server died): the request goes on core SCHEDULE rather than wait
        4-9 s; a conductor that placed it so drops the stored copy, should it come."""
        if not self.cfg.durable_intake or req.core_path:
            await bus.publish(self.nc, subjects.SCHEDULE, req)
            return
        try:
            await bus.js_publish(
                self.js,
                subjects.SCHEDULE_QUEUE,
                encode(req),
                msg_id=req.request_id,
                headers=inject(),
                timeout=self.cfg.intake_patience_s or 30.0,
            )
        except intake_queue.STALLED as e:  # no leader: the core path (refused: raised)
            if not self.cfg.intake_patience_s:
                raise
            self.bypasses += 1
            metrics.INTAKE_BYPASSES.labels(hop="admission").inc()
            log.warning("schedule_queue_stalled_core_path", error=f"{type(e).__name__}: {e}")
            await bus.publish(
                self.nc, subjects.SCHEDULE, msgspec.structs.replace(req, core_path=True)
            )

    def fill(self, req: GenerateRequest, reply: str) -> tuple[GenerateRequest, str]:
        """The request with reply subject, block size/hashes and arrival time filled in,
        or a reason it is a bad request."""
        if not req.prompt_token_ids:
            return req, "empty prompt"
        if req.block_size < 0:
            return req, "block_size must be positive"
        bad = req.sampling.problem()
        if bad is not None:
            return req, bad[1]
        bs = req.block_size or self.cfg.block_size
        # The one check of the block hashes between the gateway and placement: here a
        # request from another login (the gateway's, or a bus client's on
        # perigee.requests / perigee.intake) enters the control plane. Their number must
        # match the prompt's full blocks; their values are the client's to choose (a
        # salted chain shares nothing, perigee bench migration). The conductor trusts
        # the field (services.conductor.placement_policy.PlacementRequest.from_request says why).
        try:
            hashes = hashes_for(req.prompt_token_ids, req.block_hashes, bs, bs)
        except ValueError as e:
            return req, str(e)
        filled = msgspec.structs.replace(
            req,
            reply_subject=reply,
            block_size=bs,
            block_hashes=hashes,
            arrival_ts=req.arrival_ts or time.time(),
        )
        return filled, ""

    async def _error(
        self,
        request_id: str,
        reply: str,
        code: ErrorCode,
        message: str,
        retry_after_s: float | None = None,
    ) -> None:
        await bus.send_error(self.nc, "admission", request_id, reply, code, message, retry_after_s)
