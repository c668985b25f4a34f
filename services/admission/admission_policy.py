"""Admission control (paper §4.3): decide at the door whether a request may enter.

Pure: an injected :class:`Clock` and :class:`CostModel`, no I/O. The admission service
feeds load reports and asks :meth:`AdmissionPolicy.decide`; the simulator drives the
same classes. ``cost(i)`` below is instance i's own fitted model from the
:class:`~services.common.calibration.CalibrationBook` (the fit its load reports carry;
the prior ``cost`` until then, or always with a fixed book: ``--cost-model``), and a
prefill instance's ``queued_work_s`` is already in its own measured seconds.

Modes (``make_admission_policy(name, ...)``):

- ``baseline`` (§4.3.2's strawman): accept everything here; the conductor still rejects
  a request whose predicted TTFT misses the SLO (Algorithm 1), and the decode instance
  rejects it *after its prefill* when taking it on would break the TBT SLO
  (:class:`services.policy.decode_side_check.DecodeSideCheck`, wired into the decode worker;
  the conductor then places with no TBT check: one mode for all three,
  services.common.admission_mode). That prefill was wasted.
- ``early`` (§4.3.2 Early Rejection): accept only if both pools are under their SLO
  load, judged from the latest reports of live instances::

      prefill load = min over live prefill i of  queued_work_s(i) / TTFT_SLO
      decode load  = min over live decode d of
                     cost(d).tbt_joining(batch(d), waiting(d), kv_tokens(d), n, max_batch(d)) / TBT_SLO
      accept  iff  max(prefill load, decode load) <= max_load     (default 1.0)

  A role with no live instance rejects with 503.

  Neither minimum walks the pool: each report re-keys its instance in an order
  (O(log n)); the prefill load is the first live instance's. Decode instances in the
  same reported state (running, waiting, kv_tokens, max_batch) predict alike, so the
  decode load walks the states from the least KV, idle and busy apart, and stops once
  the cost floor's TBT at that KV plus the request's tokens (any batch, any instance's
  model: services.common.cost_floor) reaches the best share found. Exact: the same
  value as the scan over every live instance (``pruned = False``), which is what runs
  while a decode instance has a model of its own (then states no longer predict alike).

- ``predict`` (§4.3.4 Early Rejection based on Prediction, system level, uniform
  decode time ``t_d``): :class:`PredictiveRejectionPolicy` (its docstring has the rule).
"""

import heapq
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sortedcontainers import SortedList

from bus_schemas.load import DecodeLoad, PrefillLoad
from bus_schemas.requests import ErrorCode
from bus_schemas.roles import Role
from services.admission.time_index import TimeIndex
from services.common import defaults
from services.common.calibration import CalibrationBook
from services.common.clock import Clock
from services.common.cost_model import CostModel
from services.common.incarnation import STALE
from services.common.load_book import LoadBook
from services.common.rejection import Rejection, slo_share
from services.common.slo_check import TbtCheck


@dataclass(frozen=True)
class AdmissionRequest:
    """What admission needs of a request: its size and its SLOs."""

    request_id: str
    num_tokens: int  # prompt length
    max_tokens: int = 16
    ttft_slo_s: float | None = None  # None: the policy's default
    tbt_slo_s: float | None = None
    seqs: int = 1  # decode sequences (OpenAI's n): priced as n joining the instance


@dataclass(frozen=True)
class Accept:
    """Admission's yes, with the pool loads it judged by."""

    prefill_load: float = 0.0
    decode_load: float = 0.0


AdmissionDecision = Accept | Rejection


State = tuple[int, int, int, int]  # a decode report's (running, waiting, kv_tokens, max_batch)


class _States:
    """Decode instances grouped by reported state, the states in order of KV tokens,
    idle and busy apart (an idle instance's share is capped); O(log n) a change."""

    def __init__(self) -> None:
        self.of: dict[str, State] = {}
        self.names: dict[State, set[str]] = {}
        self.idle: SortedList = SortedList()  # (kv_tokens, state)
        self.busy: SortedList = SortedList()

    def set(self, instance: str, state: State) -> None:
        old = self.of.get(instance)
        if old == state:
            return
        if old is not None:
            self._drop(instance, old)
        self.of[instance] = state
        group = self.names.get(state)
        if group is None:
            group = self.names[state] = set()
            self._list(state).add((state[2], state))
        group.add(instance)

    def discard(self, instance: str) -> None:
        old = self.of.pop(instance, None)
        if old is not None:
            self._drop(instance, old)

    def _drop(self, instance: str, state: State) -> None:
        group = self.names[state]
        group.discard(instance)
        if not group:
            del self.names[state]
            self._list(state).remove((state[2], state))

    def _list(self, state: State) -> SortedList:
        return self.idle if state[0] + state[1] == 0 else self.busy

    def __len__(self) -> int:
        return len(self.of)


class _Order:
    """instance -> key, walked in ascending (key, instance) order; O(log n) a change."""

    def __init__(self) -> None:
        self.keys: dict[str, float] = {}
        self._sorted: SortedList = SortedList()

    def set(self, instance: str, key: float) -> None:
        old = self.keys.get(instance)
        if old is not None:
            if old == key:
                return
            self._sorted.remove((old, instance))
        self.keys[instance] = key
        self._sorted.add((key, instance))

    def discard(self, instance: str) -> None:
        old = self.keys.pop(instance, None)
        if old is not None:
            self._sorted.remove((old, instance))

    def __iter__(self) -> Iterator[tuple[float, str]]:
        return iter(self._sorted)

    def __len__(self) -> int:
        return len(self.keys)


class AdmissionPolicy(ABC):
    """Keeps the latest load report per instance and which instances are alive (a
    :class:`LoadBook`); a mode implements :meth:`decide`."""

    name = "abstract"

    def __init__(
        self,
        clock: Clock,
        cost: CostModel,
        *,
        ttft_slo_s: float = defaults.TTFT_SLO_S,
        tbt_slo_s: float = defaults.TBT_SLO_S,
        dead_after_s: float = defaults.DEAD_AFTER_S,
        max_load: float = 1.0,
        min_retry_after_s: float = 1.0,
        book: CalibrationBook | None = None,
    ) -> None:
        self.clock = clock
        self.cost = cost
        self.loads = LoadBook(clock, cost, dead_after_s=dead_after_s, calibration=book)
        self.book = self.loads.calibration
        self.ttft_slo_s = ttft_slo_s
        self.tbt_slo_s = tbt_slo_s
        self.max_load = max_load
        self.min_retry_after_s = min_retry_after_s
        # The latest reports in load order (the minima below walk these, not the pool).
        self._prefill_order = _Order()  # by queued_work_s
        self._states = _States()
        self._own_models: set[str] = set()  # decode instances with a fit of their own
        self.pruned = True  # False: scan every live instance (the reference)

    @property
    def prefill(self) -> dict[str, PrefillLoad]:
        return self.loads.prefill

    @property
    def decode(self) -> dict[str, DecodeLoad]:
        return self.loads.decode

    def observe_prefill(self, load: PrefillLoad) -> None:
        if self.loads.observe_prefill(load) != STALE:
            self._prefill_order.set(load.instance, load.queued_work_s)

    def observe_decode(self, load: DecodeLoad) -> None:
        if self.loads.observe_decode(load) != STALE:
            self._key_decode(load)

    def forget_instance(self, role: str, instance: str) -> None:
        """``instance`` left ``role`` (a role switch): its last report there no longer counts."""
        self.loads.forget(role, instance)
        if role == Role.PREFILL:
            self._prefill_order.discard(instance)
        else:
            self._states.discard(instance)
            self._own_models.discard(instance)

    def _orders_in_step(self) -> bool:
        """The orders hold exactly the book's instances (the book forgets the long
        silent on its own: then they are rebuilt)."""
        book = self.loads
        if len(self._prefill_order) != len(book.prefill):
            self._prefill_order = _Order()
            for p in book.prefill.values():
                self._prefill_order.set(p.instance, p.queued_work_s)
        if len(self._states) != len(book.decode):
            self._states = _States()
            self._own_models = set()
            for d in book.decode.values():
                self._key_decode(d)
        return not self._own_models

    def _key_decode(self, load: DecodeLoad) -> None:
        """Key ``load``'s instance in the decode orders (its report already booked)."""
        name = load.instance
        cost = self.book.cost(name)
        if cost is self.book.prior:
            self._own_models.discard(name)
        else:
            self._own_models.add(name)
        state = (load.batch_size, load.waiting, load.kv_tokens, load.max_batch)
        self._states.set(name, state)

    @abstractmethod
    def decide(self, req: AdmissionRequest) -> AdmissionDecision: ...

    def on_accepted(self, req: AdmissionRequest) -> None:  # noqa: B027 - optional hook
        """Called after an Accept was acted on (predictive modes track what they let in)."""

    def live_prefill(self) -> list[PrefillLoad]:
        return self.loads.live_prefill()

    def live_decode(self) -> list[DecodeLoad]:
        return self.loads.live_decode()

    def ttft_slo(self, req: AdmissionRequest) -> float:
        return self.ttft_slo_s if req.ttft_slo_s is None else req.ttft_slo_s

    @property
    def tbt_rule(self) -> TbtCheck:
        """The TBT rule placement and the decode side apply too; an idle decode
        instance always counts at most ``max_load`` here."""
        return TbtCheck(self.max_load, serve_when_idle=True)

    def tbt_slo(self, req: AdmissionRequest) -> float:
        return self.tbt_slo_s if req.tbt_slo_s is None else req.tbt_slo_s

    def prefill_load(self, req: AdmissionRequest) -> float | None:
        """Least-loaded live prefill instance's queue over the TTFT SLO (None: none live)."""
        if self.pruned and self._orders_in_step():
            alive, slo = self.loads.alive, self.ttft_slo(req)
            for q, name in self._prefill_order:
                if alive(Role.PREFILL, name):
                    return slo_share(q, slo)
            return None
        live = self.live_prefill()
        if not live:
            return None
        return min(slo_share(p.queued_work_s, self.ttft_slo(req)) for p in live)

    def decode_load(self, req: AdmissionRequest) -> float | None:
        """Least-loaded live decode instance's TBT with this request over the TBT SLO.

        An idle instance (nothing running or waiting) counts as at most ``max_load``:
        the request alone is the best TBT it can ever get, so waiting would not help it,
        and rejecting it there would leave a model that predicts too slow with no
        samples to correct it (every request turned away, the engine idle)."""
        if self.pruned and self._orders_in_step():
            return self._decode_load_pruned(req)
        live = self.live_decode()
        if not live:
            return None
        slo = self.tbt_slo(req)
        rule = self.tbt_rule
        return min(
            rule.share(
                rule.tbt(
                    self.book.cost(d.instance),
                    d.batch_size,
                    d.waiting,
                    d.kv_tokens,
                    req.num_tokens,
                    d.max_batch,
                    req.seqs,
                ),
                slo,
                idle=d.batch_size + d.waiting == 0,
            )
            for d in live
        )

    def _decode_load_pruned(self, req: AdmissionRequest) -> float | None:
        """:meth:`decode_load` from the states: one share per state with a live
        instance, each walk stopped where the floor's share at its KV reaches the best
        found (the floor grows with the KV; the cap of the idle keeps it monotone)."""
        slo, n, rule, seqs = self.tbt_slo(req), req.num_tokens, self.tbt_rule, req.seqs
        alive, cost, floor = self.loads.alive, self.book.prior, self.book.floor.tbt
        states = self._states
        best: float | None = None
        for order, idle in ((states.idle, True), (states.busy, False)):
            for kv, state in order:
                if best is not None and rule.share(floor(kv + seqs * n), slo, idle=idle) >= best:
                    break
                if not any(alive(Role.DECODE, name) for name in states.names[state]):
                    continue
                running, waiting, _, max_batch = state
                tbt = rule.tbt(cost, running, waiting, kv, n, max_batch, seqs)
                share = rule.share(tbt, slo, idle=idle)
                if best is None or share < best:
                    best = share
        return best


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
            return Rejection(
                ErrorCode.UNAVAILABLE, "no live prefill instance", self.min_retry_after_s
            )
        dl = self.decode_load(req)
        if dl is None:
            return Rejection(
                ErrorCode.UNAVAILABLE, "no live decode instance", self.min_retry_after_s
            )
        if pl > self.max_load:
            excess = (pl - self.max_load) * self.ttft_slo(req)
            return Rejection(
                ErrorCode.REJECTED,
                f"prefill pool overloaded (load {pl:.2f} > {self.max_load:g})",
                max(self.min_retry_after_s, excess),
            )
        if dl > self.max_load:
            return Rejection(
                ErrorCode.REJECTED,
                f"decode pool overloaded (load {dl:.2f} > {self.max_load:g})",
                self.min_retry_after_s,
            )
        return Accept(prefill_load=pl, decode_load=dl)


@dataclass
class _Admitted:
    accepted_at: float
    prefill_done_at: float  # predicted: joins the decode pool then
    tokens: int  # context it brings to the decode pool: the prompt once per sequence
    work_s: float  # predicted prefill work
    seqs: int = 1  # decode sequences (OpenAI's n)


class PredictiveRejectionPolicy(EarlyRejectionPolicy):
    """§4.3.4, system level: predict the decode load at the moment this request's prefill
    completes, assuming every request decodes for a uniform ``t_d`` (``decode_time_s``).

    Prefill side (as Early Rejection, plus what this policy admitted that no report has
    shown yet): for each live prefill instance i,
    ``wait_i = queued_work_s(i) + sum(work of admitted requests accepted after i's last
    report, + report_grace_s) / #live prefill``; ``wait = min_i wait_i``; prefill load =
    ``wait / TTFT_SLO``. The request's prefill completes at
    ``t = now + min_i (wait_i + cost(i).prefill_time(n))`` (no prefix credit: admission
    has no cache view), and that instance's ``cost(i).prefill_time(n)`` is its work.

    Decode side, at ``t`` (horizon ``h = t - now``):

    - admitted requests with predicted prefill completion ``f_r <= t < f_r + t_d`` are
      in the decode pool at ``t`` (those finishing prefill by then join, those older
      than ``t_d`` have left), each as its ``s`` sequences (OpenAI's n) with its prompt
      tokens once per sequence, as placement prices them;
    - the reported residents (sum of batch + waiting over live decode instances) minus
      the admitted ones already in decode (``f_r <= now < f_r + t_d``) are residents of
      unknown age; with uniform ``t_d`` their ages are spread evenly, so a fraction
      ``max(0, 1 - h / t_d)`` of them, and of their share of kv_tokens, is still there;
    - this request joins (+s sequences, +s x n tokens);
    - spread evenly over the D live decode instances, each sees
      ``cost(d).decode_tbt(batch / D, tokens / D, max_batch)`` (past its ``max_batch`` the
      sequences take turns, as placement and Early Rejection count them); decode load =
      the mean of that over the instances / TBT_SLO.

    Accept iff both loads are <= ``max_load``. :meth:`on_accepted` records the request
    (accept time, predicted ``f``, tokens, work); entries leave after ``f + t_d``.

    Cost per decision: O(live instances + log T), not O(admitted): each prefill
    instance keeps the running sum of the admitted work its last report has not seen
    (reset from the requests of the last ``report_grace_s`` on each report, adjusted
    as requests come and go); two :class:`TimeIndex` count the admitted requests'
    sequences (and their tokens) that have joined the decode pool (``f <= x``) and left it
    (``f + t_d <= x``) by any time x; a heap on ``f + t_d`` expires them.
    """

    name = "predict"

    def __init__(
        self,
        clock: Clock,
        cost: CostModel,
        *,
        decode_time_s: float = 5.0,
        report_grace_s: float = 0.0,
        **kw: Any,
    ) -> None:
        super().__init__(clock, cost, **kw)
        if decode_time_s <= 0:
            raise ValueError("decode_time_s (t_d) must be positive")
        self.decode_time_s = decode_time_s
        self.report_grace_s = report_grace_s
        self.admitted: dict[str, _Admitted] = {}
        self._seen_at: dict[str, float] = {}  # prefill instance -> when its report came
        self._unseen: dict[str, float] = {}  # prefill instance -> admitted work not reported
        self._recent: deque[tuple[float, str, _Admitted]] = deque()  # accepted within grace
        self._expiry: list[tuple[float, int, str, _Admitted]] = []  # heap on f + t_d
        self._seq = 0
        origin = clock.now()
        self._joined = TimeIndex(origin)  # admitted by f
        self._left = TimeIndex(origin)  # admitted by f + t_d

    def observe_prefill(self, load: PrefillLoad) -> None:
        super().observe_prefill(load)
        now = self.clock.now()
        self._seen_at[load.instance] = now
        grace, recent = self.report_grace_s, self._recent
        while recent and recent[0][0] + grace <= now:  # seen by this and every later report
            recent.popleft()
        unseen = 0.0
        for accepted_at, rid, a in reversed(recent):
            if accepted_at + grace <= now:
                break
            if self.admitted.get(rid) is a:
                unseen += a.work_s
        self._unseen[load.instance] = unseen

    def forget_instance(self, role: str, instance: str) -> None:
        super().forget_instance(role, instance)
        if role == Role.PREFILL:
            self._seen_at.pop(instance, None)
            self._unseen.pop(instance, None)

    # ------------------------------------------------------------ bookkeeping

    def _add(self, rid: str, a: _Admitted) -> None:
        self._drop(rid)
        self.admitted[rid] = a
        grace = self.report_grace_s
        for inst, seen in self._seen_at.items():
            if a.accepted_at + grace > seen:
                self._unseen[inst] += a.work_s
        recent = self._recent
        while recent and recent[0][0] + grace <= a.accepted_at:  # every report from now on saw it
            recent.popleft()
        recent.append((a.accepted_at, rid, a))
        self._joined.add(rid, a.prefill_done_at, a.tokens, a.seqs)
        leave = a.prefill_done_at + self.decode_time_s
        self._left.add(rid, leave, a.tokens, a.seqs)
        self._seq += 1
        heapq.heappush(self._expiry, (leave, self._seq, rid, a))

    def _drop(self, rid: str) -> None:
        a = self.admitted.pop(rid, None)
        if a is None:
            return
        grace = self.report_grace_s
        for inst, seen in self._seen_at.items():
            if a.accepted_at + grace > seen:
                self._unseen[inst] -= a.work_s
        self._joined.remove(rid)
        self._left.remove(rid)

    def _gc(self, now: float) -> None:
        heap = self._expiry
        while heap and heap[0][0] <= now:
            _, _, rid, a = heapq.heappop(heap)
            if self.admitted.get(rid) is a:
                self._drop(rid)

    # ------------------------------------------------------------ predictions

    def prefill_wait(self) -> float | None:
        """Predicted queueing before a new request's prefill starts (None: no instance)."""
        live = self.live_prefill()
        if not live:
            return None
        share = 1.0 / len(live)
        return min(p.queued_work_s + self._unseen.get(p.instance, 0.0) * share for p in live)

    def _prefill_plan(self, req: AdmissionRequest) -> tuple[float, float] | None:
        """(queueing, prefill work) on the live prefill instance that would finish the
        request first, each instance at its own cost (None: no instance)."""
        live = self.live_prefill()
        if not live:
            return None
        share = 1.0 / len(live)
        return min(
            (
                (
                    p.queued_work_s + self._unseen.get(p.instance, 0.0) * share,
                    self.book.cost(p.instance).prefill_time(req.num_tokens),
                )
                for p in live
            ),
            key=lambda plan: plan[0] + plan[1],
        )

    def prefill_done_at(self, req: AdmissionRequest) -> float | None:
        plan = self._prefill_plan(req)
        if plan is None:
            return None
        return self.clock.now() + plan[0] + plan[1]

    def _in_decode(self, at: float) -> tuple[int, int]:
        """(sequences, tokens) of the admitted with ``f <= at < f + t_d``."""
        joined, joined_tokens = self._joined.upto(at)
        left, left_tokens = self._left.upto(at)
        return joined - left, joined_tokens - left_tokens

    def predicted_decode(
        self, at: float, join_tokens: int | None, join_seqs: int = 1
    ) -> tuple[float, float]:
        """(batch, context tokens) of the whole decode pool at time ``at``, plus one
        request of ``join_tokens`` and ``join_seqs`` sequences if not None."""
        now = self.clock.now()
        td = self.decode_time_s
        live = self.live_decode()
        reported = sum(d.batch_size + d.waiting for d in live)
        kv = sum(d.kv_tokens for d in live)
        in_now, _ = self._in_decode(now)
        unknown = max(0, reported - in_now)
        survive = max(0.0, 1.0 - (at - now) / td)
        batch = unknown * survive
        ctx = (kv * unknown / reported if reported else 0.0) * survive
        count, tokens = self._in_decode(at)
        batch += count
        ctx += tokens
        if join_tokens is not None:
            batch += join_seqs
            ctx += join_seqs * join_tokens
        return batch, ctx

    def prefill_load(self, req: AdmissionRequest) -> float | None:
        wait = self.prefill_wait()
        return None if wait is None else slo_share(wait, self.ttft_slo(req))

    def decode_load(self, req: AdmissionRequest) -> float | None:
        live = self.live_decode()
        at = self.prefill_done_at(req)
        if not live or at is None:
            return None
        batch, ctx = self.predicted_decode(at, req.num_tokens, req.seqs)
        n = len(live)
        tbt = (
            sum(
                self.book.cost(d.instance).decode_tbt(batch / n, ctx / n, d.max_batch) for d in live
            )
            / n
        )
        # Alone in the predicted pool: as an idle instance in Early Rejection.
        return self.tbt_rule.share(tbt, self.tbt_slo(req), idle=batch <= req.seqs)

    def decide(self, req: AdmissionRequest) -> AdmissionDecision:
        self._gc(self.clock.now())
        return super().decide(req)

    def on_accepted(self, req: AdmissionRequest) -> None:
        plan = self._prefill_plan(req)
        if plan is None:
            return
        now = self.clock.now()
        self._add(
            req.request_id,
            _Admitted(
                accepted_at=now,
                prefill_done_at=now + plan[0] + plan[1],
                tokens=req.num_tokens * req.seqs,
                work_s=plan[1],
                seqs=req.seqs,
            ),
        )

    def forget(self, request_id: str) -> None:
        """The request ended early (rejected downstream, cancelled)."""
        self._drop(request_id)


ADMISSION_POLICIES: dict[str, type[AdmissionPolicy]] = {
    BaselinePolicy.name: BaselinePolicy,
    EarlyRejectionPolicy.name: EarlyRejectionPolicy,
    PredictiveRejectionPolicy.name: PredictiveRejectionPolicy,
}


def make_admission_policy(name: str, clock: Clock, cost: CostModel, **kw: Any) -> AdmissionPolicy:
    """Build the policy registered as ``name`` (``baseline`` | ``early`` | ``predict``).
    ``predict`` takes ``decode_time_s`` (t_d) and ``report_grace_s`` besides the rest."""
    try:
        cls = ADMISSION_POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown admission policy {name!r}; known: {sorted(ADMISSION_POLICIES)}"
        ) from None
    return cls(clock, cost, **kw)
