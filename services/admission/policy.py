"""Admission control (paper §4.3): decide at the door whether a request may enter.

Pure: an injected :class:`Clock` and :class:`CostModel`, no I/O. The admission service
feeds load reports and asks :meth:`AdmissionPolicy.decide`; the simulator drives the
same classes.

Modes (``make_admission_policy(name, ...)``):

- ``baseline``: accept everything here (the conductor may still reject on its own
  TTFT/TBT prediction, which is the paper's "reject after scheduling" behaviour).
- ``early`` (§4.3.2 Early Rejection): accept only if both pools are under their SLO
  load, judged from the latest reports of live instances::

      prefill load = min over live prefill i of  queued_work_s(i) / TTFT_SLO
      decode load  = min over live decode d of
                     cost.decode_step_time(batch(d) + waiting(d) + 1, kv_tokens(d) + n) / TBT_SLO
      accept  iff  max(prefill load, decode load) <= max_load     (default 1.0)

  A role with no live instance rejects with 503.

A ``predict`` mode (§4.3.4, decode load predicted at prefill completion) subclasses
:class:`EarlyRejectionPolicy` and overrides :meth:`decode_load` (and may use
:meth:`on_accepted` to track what it let in).
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass

from bus_schemas.load import DecodeLoad, PrefillLoad
from bus_schemas.requests import ErrorCode
from services.common.clock import Clock
from services.common.cost_model import CostModel
from services.common.liveness import Liveness


@dataclass(frozen=True)
class AdmissionRequest:
    request_id: str
    num_tokens: int  # prompt length
    max_tokens: int = 16
    ttft_slo_s: float | None = None  # None: the policy's default
    tbt_slo_s: float | None = None


@dataclass(frozen=True)
class Accept:
    prefill_load: float = 0.0
    decode_load: float = 0.0


@dataclass(frozen=True)
class Reject:
    code: ErrorCode  # REJECTED (429) or UNAVAILABLE (503)
    reason: str
    retry_after_s: float | None = None


AdmissionDecision = Accept | Reject


class AdmissionPolicy(ABC):
    """Keeps the latest load report per instance and which instances are alive; a mode
    implements :meth:`decide`."""

    name = "abstract"

    def __init__(
        self,
        clock: Clock,
        cost: CostModel,
        *,
        ttft_slo_s: float = 30.0,
        tbt_slo_s: float = 0.1,
        dead_after_s: float = 2.0,
        max_load: float = 1.0,
        min_retry_after_s: float = 1.0,
    ) -> None:
        self.clock = clock
        self.cost = cost
        self.ttft_slo_s = ttft_slo_s
        self.tbt_slo_s = tbt_slo_s
        self.max_load = max_load
        self.min_retry_after_s = min_retry_after_s
        self._liveness = Liveness(clock, dead_after_s)
        self.prefill: dict[str, PrefillLoad] = {}
        self.decode: dict[str, DecodeLoad] = {}

    def observe_prefill(self, load: PrefillLoad) -> None:
        self.prefill[load.instance] = load
        self._liveness.seen("prefill:" + load.instance)

    def observe_decode(self, load: DecodeLoad) -> None:
        self.decode[load.instance] = load
        self._liveness.seen("decode:" + load.instance)

    @abstractmethod
    def decide(self, req: AdmissionRequest) -> AdmissionDecision: ...

    def on_accepted(self, req: AdmissionRequest) -> None:  # noqa: B027 - optional hook
        """Called after an Accept was acted on (predictive modes track what they let in)."""

    def live_prefill(self) -> list[PrefillLoad]:
        return [v for k, v in sorted(self.prefill.items()) if self._liveness.alive("prefill:" + k)]

    def live_decode(self) -> list[DecodeLoad]:
        return [v for k, v in sorted(self.decode.items()) if self._liveness.alive("decode:" + k)]

    def ttft_slo(self, req: AdmissionRequest) -> float:
        return self.ttft_slo_s if req.ttft_slo_s is None else req.ttft_slo_s

    def tbt_slo(self, req: AdmissionRequest) -> float:
        return self.tbt_slo_s if req.tbt_slo_s is None else req.tbt_slo_s

    def prefill_load(self, req: AdmissionRequest) -> float | None:
        """Least-loaded live prefill instance's queue over the TTFT SLO (None: none live)."""
        live = self.live_prefill()
        if not live:
            return None
        return min(_over(p.queued_work_s, self.ttft_slo(req)) for p in live)

    def decode_load(self, req: AdmissionRequest) -> float | None:
        """Least-loaded live decode instance's TBT with this request over the TBT SLO."""
        live = self.live_decode()
        if not live:
            return None
        slo = self.tbt_slo(req)
        return min(
            _over(
                self.cost.decode_step_time(
                    d.batch_size + d.waiting + 1, d.kv_tokens + req.num_tokens
                ),
                slo,
            )
            for d in live
        )


class BaselinePolicy(AdmissionPolicy):
    """Admit everything; overload is left to the conductor's own SLO check."""

    name = "baseline"

    def decide(self, req: AdmissionRequest) -> AdmissionDecision:
        return Accept()


class EarlyRejectionPolicy(AdmissionPolicy):
    """§4.3.2: both pools must be under their SLO load before prefill starts."""

    name = "early"

    def decide(self, req: AdmissionRequest) -> AdmissionDecision:
        pl = self.prefill_load(req)
        if pl is None:
            return Reject(ErrorCode.UNAVAILABLE, "no live prefill instance", self.min_retry_after_s)
        dl = self.decode_load(req)
        if dl is None:
            return Reject(ErrorCode.UNAVAILABLE, "no live decode instance", self.min_retry_after_s)
        if pl > self.max_load:
            excess = (pl - self.max_load) * self.ttft_slo(req)
            return Reject(
                ErrorCode.REJECTED,
                f"prefill pool overloaded (load {pl:.2f} > {self.max_load:g})",
                max(self.min_retry_after_s, excess),
            )
        if dl > self.max_load:
            return Reject(
                ErrorCode.REJECTED,
                f"decode pool overloaded (load {dl:.2f} > {self.max_load:g})",
                self.min_retry_after_s,
            )
        return Accept(prefill_load=pl, decode_load=dl)


ADMISSION_POLICIES: dict[str, type[AdmissionPolicy]] = {
    BaselinePolicy.name: BaselinePolicy,
    EarlyRejectionPolicy.name: EarlyRejectionPolicy,
}


def make_admission_policy(name: str, clock: Clock, cost: CostModel, **kw) -> AdmissionPolicy:
    """Build the policy registered as ``name`` (``baseline`` | ``early``; more later)."""
    try:
        cls = ADMISSION_POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown admission policy {name!r}; known: {sorted(ADMISSION_POLICIES)}"
        ) from None
    return cls(clock, cost, **kw)


def _over(value: float, slo: float) -> float:
    if slo <= 0:
        return 0.0 if value <= 0 else float("inf")
    return value / slo
