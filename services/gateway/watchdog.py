"""Fails in-flight requests whose worker died or whose backend went quiet. Pure.

A tracked request moves through three stages:

    QUEUED   (published, nothing heard)    -> only the idle timeout applies
    PREFILL  (Accepted, no token from the  -> prefill and decode instance must be alive
              decode instance yet)
    DECODE   (Tokens from decode seen)     -> decode instance must be alive

The first token streamed by prefill (``Tokens.from_prefill``) keeps the request in
PREFILL: prefill still has to ship its KV and hand it over.

An instance is alive while it published a load report (or streamed tokens) within
``dead_after_s`` (:class:`services.common.liveness.Liveness`). An instance named by
Accepted that never reported is treated as first seen at that moment, so a worker
that never reports is declared dead ``dead_after_s`` later rather than never. Before
the first token the decode instance is checked too: it holds the request's KV slots
and would produce the first token, so its death dooms the request as surely.

An instance is its incarnation, not its name (services.common.incarnation): Accepted
names the incarnations placed on, and a load report or token of a newer incarnation
under the same name is the death of the old one, whatever the heartbeats say. A
restart within ``dead_after_s`` (``perigee up``, a Kubernetes container restart) is
thus a death at once, not a request stranded until its timeout.

Liveness also needs progress: an instance that reports load but produced nothing for a
request it holds, for ``wedge_factor`` times its own prediction plus ``wedge_floor_s``,
is wedged, and the request's verdict is a death as well. The prediction is the
conductor's TTFT estimate (Accepted) until the first token, then the decode instance's
reported step time.

Independently, a request with no event at all for ``request_timeout_s`` times out.
:meth:`Watchdog.sweep` returns the verdicts and stops tracking those requests; a sweep
told its input is stale (the gateway's own bus input is lagging, so silence proves
nothing about the instances) gives no death verdicts.
"""

import dataclasses
from dataclasses import dataclass

from bus_schemas.requests import ErrorCode
from bus_schemas.roles import Role
from services.common import defaults
from services.common.clock import Clock
from services.common.incarnation import RESTARTED, STALE
from services.common.liveness import Liveness


@dataclass(slots=True)
class _Tracked:
    last_event: float
    prefill: str = ""
    decode: str = ""
    decoding: bool = False
    prefill_inc: int = 0  # the incarnations placed on (0: unknown)
    decode_inc: int = 0
    est_ttft_s: float = 0.0
    progress: float = 0.0  # when it was accepted, or its latest token came
    first_token: bool = False


@dataclass(frozen=True, slots=True)
class Verdict:
    """The watchdog's ruling on a request: the error it gets and, on a death, who died."""

    request_id: str
    code: ErrorCode
    message: str
    # Set when the verdict is a death: the role and instance that died (the gateway
    # may migrate the request instead of failing it: services.gateway.resend).
    dead_role: str = ""
    dead_instance: str = ""
    dead_incarnation: int = 0
    # The (instance, incarnation) pairs that held the request: its cancel goes to them.
    placement: tuple[tuple[str, int], ...] = ()
    # The instance is alive but made no progress (Migration.wedged).
    wedged: bool = False


class Watchdog:
    """Tracks requests in flight and fails those whose worker died or went quiet."""

    def __init__(
        self,
        clock: Clock,
        dead_after_s: float = defaults.DEAD_AFTER_S,
        request_timeout_s: float = 120.0,
        wedge_factor: float = 10.0,
        wedge_floor_s: float = 10.0,
    ) -> None:
        self.clock = clock
        self.dead_after_s = dead_after_s
        self.request_timeout_s = request_timeout_s
        self.wedge_factor = wedge_factor
        self.wedge_floor_s = wedge_floor_s
        self.liveness = Liveness(clock, dead_after_s)
        self._reqs: dict[str, _Tracked] = {}
        self._step_s: dict[str, float] = {}  # decode instance -> its reported step time
        self.restarts = 0  # new incarnations seen
        self.wedged = 0  # requests judged stuck on a live instance

    def __len__(self) -> int:
        return len(self._reqs)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._reqs

    # ---- feeds ---------------------------------------------------------------------
    def seen(self, instance: str, incarnation: int = 0, step_s: float | None = None) -> bool:
        """A load report (or any sign of life) from ``instance``; True when it is a new
        incarnation (a restart: the caller sweeps at once)."""
        verdict = self.liveness.seen(instance, incarnation)
        if verdict == STALE:
            return False
        if step_s is not None:
            self._step_s[instance] = step_s
        if verdict == RESTARTED:
            self.restarts += 1
            return True
        return False

    def track(self, request_id: str) -> None:
        self._reqs[request_id] = _Tracked(last_event=self.clock.now())

    def untrack(self, request_id: str) -> None:
        self._reqs.pop(request_id, None)

    def placement(self, request_id: str) -> tuple[tuple[str, int], ...]:
        """The (instance, incarnation) pairs holding ``request_id`` (for its cancel)."""
        r = self._reqs.get(request_id)
        if r is None:
            return ()
        return tuple((i, n) for i, n in ((r.prefill, r.prefill_inc), (r.decode, r.decode_inc)) if i)

    def accepted(
        self,
        request_id: str,
        prefill_instance: str,
        decode_instance: str,
        prefill_incarnation: int = 0,
        decode_incarnation: int = 0,
        est_ttft_s: float = 0.0,
    ) -> bool:
        """Track the placement; True when it names a newer incarnation than known (a
        restart, as :meth:`seen`)."""
        r = self._reqs.get(request_id)
        if r is None:
            return False
        now = self.clock.now()
        r.last_event = r.progress = now
        r.prefill, r.decode = prefill_instance, decode_instance
        r.prefill_inc, r.decode_inc = prefill_incarnation, decode_incarnation
        r.est_ttft_s = est_ttft_s
        restarted = False
        for inst, inc in (
            (prefill_instance, prefill_incarnation),
            (decode_instance, decode_incarnation),
        ):
            if not inst:
                continue
            if not self.liveness.known(inst):
                self.liveness.seen(inst, inc)
            elif inc and self.liveness.incarnation(inst) < inc:
                # Placed on an incarnation this gateway has not heard report yet.
                restarted |= self.seen(inst, inc)
        return restarted

    def tokens(self, request_id: str, from_prefill: bool = False, incarnation: int = 0) -> None:
        r = self._reqs.get(request_id)
        if r is None:
            return
        r.last_event = r.progress = self.clock.now()
        r.first_token = True
        if from_prefill:
            if r.prefill:
                self.liveness.seen(r.prefill, incarnation)
            return
        r.decoding = True
        if r.decode:
            self.liveness.seen(r.decode, incarnation)

    def event(self, request_id: str) -> None:
        """Any other event for the request (it is not idle)."""
        r = self._reqs.get(request_id)
        if r is not None:
            r.last_event = self.clock.now()

    def forget_silent(self, older_than_s: float) -> int:
        """Forget instances silent for more than ``older_than_s`` (bounded state: names
        come and go with scaling); how many."""
        gone = self.liveness.prune(older_than_s)
        for i in gone:
            self._step_s.pop(i, None)
        return len(gone)

    # ---- verdicts ------------------------------------------------------------------
    def stage(self, request_id: str) -> str:
        r = self._reqs.get(request_id)
        if r is None:
            return "untracked"
        return Role.DECODE if r.decoding else Role.PREFILL if (r.prefill or r.decode) else "queued"

    def _suspects(self, r: _Tracked) -> tuple[tuple[str, str, int], ...]:
        if r.decoding:
            return ((Role.DECODE, r.decode, r.decode_inc),)
        return ((Role.PREFILL, r.prefill, r.prefill_inc), (Role.DECODE, r.decode, r.decode_inc))

    def _restarted(self, r: _Tracked) -> tuple[str, str, int] | None:
        for role, inst, inc in self._suspects(r):
            if inst and inc and self.liveness.incarnation(inst) > inc:
                return role, inst, inc
        return None

    def _dead(self, r: _Tracked) -> tuple[str, str, int] | None:
        for role, inst, inc in self._suspects(r):
            if inst and not self.liveness.alive(inst):
                return role, inst, inc
        return None

    def _wedged(self, r: _Tracked, now: float) -> tuple[str, str, int, float] | None:
        """(role, instance, incarnation, budget) when the request made no progress for
        longer than its prediction allows."""
        if not (r.prefill or r.decode):
            return None
        if not r.first_token:
            predicted = r.est_ttft_s
        else:
            predicted = self._step_s.get(r.decode, 0.0)
        budget = self.wedge_factor * predicted + self.wedge_floor_s
        if now - r.progress <= budget:
            return None
        role, inst, inc = (
            (Role.DECODE, r.decode, r.decode_inc)
            if r.decoding
            else (Role.PREFILL, r.prefill, r.prefill_inc)
        )
        return (role, inst, inc, budget) if inst else None

    def sweep(self, judge_liveness: bool = True) -> list[Verdict]:
        """Verdicts for the requests whose instance restarted (always: a new incarnation
        is positive evidence), died or wedged (only when ``judge_liveness``: silence
        proves nothing while the caller's input lags), or that timed out."""
        now = self.clock.now()
        out: list[Verdict] = []
        for rid, r in self._reqs.items():
            restarted = self._restarted(r)
            if restarted is not None:
                role, inst, inc = restarted
                out.append(
                    Verdict(
                        rid,
                        ErrorCode.UNAVAILABLE,
                        f"{role} instance {inst} restarted (a new incarnation); request aborted",
                        role,
                        inst,
                        inc,
                    )
                )
                continue
            dead = self._dead(r) if judge_liveness else None
            if dead is not None:
                role, inst, inc = dead
                out.append(
                    Verdict(
                        rid,
                        ErrorCode.UNAVAILABLE,
                        f"{role} instance {inst} stopped responding "
                        f"(silent for more than {self.dead_after_s:g} s); request aborted",
                        role,
                        inst,
                        inc,
                    )
                )
                continue
            wedged = self._wedged(r, now) if judge_liveness else None
            if wedged is not None:
                role, inst, inc, budget = wedged
                self.wedged += 1
                out.append(
                    Verdict(
                        rid,
                        ErrorCode.UNAVAILABLE,
                        f"{role} instance {inst} made no progress on the request for "
                        f"{now - r.progress:.1f} s (predicted at most {budget:.1f} s); "
                        "request aborted",
                        role,
                        inst,
                        inc,
                        wedged=True,
                    )
                )
            elif now - r.last_event > self.request_timeout_s:
                out.append(
                    Verdict(
                        rid,
                        ErrorCode.TIMEOUT,
                        f"no response from the serving backend for {self.request_timeout_s:g} s",
                    )
                )
        for i, v in enumerate(out):
            if v.dead_role:
                out[i] = dataclasses.replace(v, placement=self.placement(v.request_id))
            del self._reqs[v.request_id]
        return out
