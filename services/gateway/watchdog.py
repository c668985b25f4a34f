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

Independently, a request with no event at all for ``request_timeout_s`` times out.
:meth:`Watchdog.sweep` returns the verdicts and stops tracking those requests; a sweep
told its input is stale (the gateway's own bus input is lagging, so silence proves
nothing about the instances) gives no death verdicts.
"""

from dataclasses import dataclass

from bus_schemas.requests import ErrorCode
from bus_schemas.roles import Role
from services.common.clock import Clock
from services.common.liveness import Liveness


@dataclass(slots=True)
class _Tracked:
    last_event: float
    prefill: str = ""
    decode: str = ""
    decoding: bool = False


@dataclass(frozen=True, slots=True)
class Verdict:
    request_id: str
    code: ErrorCode
    message: str
    # Set when the verdict is a death: the role and instance that died (the gateway
    # may migrate the request instead of failing it: services.gateway.migration).
    dead_role: str = ""
    dead_instance: str = ""


class Watchdog:
    def __init__(
        self, clock: Clock, dead_after_s: float = 2.0, request_timeout_s: float = 120.0
    ) -> None:
        self.clock = clock
        self.dead_after_s = dead_after_s
        self.request_timeout_s = request_timeout_s
        self.liveness = Liveness(clock, dead_after_s)
        self._reqs: dict[str, _Tracked] = {}

    def __len__(self) -> int:
        return len(self._reqs)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._reqs

    # ---- feeds ---------------------------------------------------------------------
    def seen(self, instance: str) -> None:
        """A load report (or any sign of life) from ``instance``."""
        self.liveness.seen(instance)

    def track(self, request_id: str) -> None:
        self._reqs[request_id] = _Tracked(last_event=self.clock.now())

    def untrack(self, request_id: str) -> None:
        self._reqs.pop(request_id, None)

    def accepted(self, request_id: str, prefill_instance: str, decode_instance: str) -> None:
        r = self._reqs.get(request_id)
        if r is None:
            return
        r.last_event = self.clock.now()
        r.prefill, r.decode = prefill_instance, decode_instance
        for inst in (prefill_instance, decode_instance):
            if inst and not self.liveness.known(inst):
                self.liveness.seen(inst)

    def tokens(self, request_id: str, from_prefill: bool = False) -> None:
        r = self._reqs.get(request_id)
        if r is None:
            return
        r.last_event = self.clock.now()
        if from_prefill:
            if r.prefill:
                self.liveness.seen(r.prefill)
            return
        r.decoding = True
        if r.decode:
            self.liveness.seen(r.decode)

    def event(self, request_id: str) -> None:
        """Any other event for the request (it is not idle)."""
        r = self._reqs.get(request_id)
        if r is not None:
            r.last_event = self.clock.now()

    # ---- verdicts ------------------------------------------------------------------
    def stage(self, request_id: str) -> str:
        r = self._reqs.get(request_id)
        if r is None:
            return "untracked"
        return Role.DECODE if r.decoding else Role.PREFILL if (r.prefill or r.decode) else "queued"

    def _dead(self, r: _Tracked) -> tuple[str, str] | None:
        if r.decoding:
            suspects = ((Role.DECODE, r.decode),)
        else:
            suspects = ((Role.PREFILL, r.prefill), (Role.DECODE, r.decode))
        for role, inst in suspects:
            if inst and not self.liveness.alive(inst):
                return role, inst
        return None

    def sweep(self, judge_liveness: bool = True) -> list[Verdict]:
        now = self.clock.now()
        out: list[Verdict] = []
        for rid, r in self._reqs.items():
            dead = self._dead(r) if judge_liveness else None
            if dead is not None:
                role, inst = dead
                out.append(
                    Verdict(
                        rid,
                        ErrorCode.UNAVAILABLE,
                        f"{role} instance {inst} stopped responding "
                        f"(silent for more than {self.dead_after_s:g} s); request aborted",
                        role,
                        inst,
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
        for v in out:
            del self._reqs[v.request_id]
        return out
