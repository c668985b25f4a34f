"""How many traces a process exports: at most ``PERIGEE_TRACE_RATE`` a second.

Exporting every request's spans costs the control plane CPU at every hop (BENCHMARKS.md,
issue 27), and a breakdown needs a few hundred traces, not every one at 400 req/s. So a
trace's root (the gateway, for a request) samples through a token bucket: every root
while they come slower than the rate, a bounded number a second above it, bursts up to
one second's worth. A root past the bucket is still *recorded* (``RECORD_ONLY``, marked
``perigee=r`` in the W3C tracestate that follows it across services), so the stage
histograms that follow spans (services.common.metrics.SpanMetrics) count every request;
only the export is skipped. Every other span follows its parent's decision, so a traced
request is traced whole across services. Below the bucket sits the ratio that
``OTEL_TRACES_SAMPLER=parentbased_traceidratio`` (``perigee up --trace-sample``) sets:
what it drops is dropped, not recorded.

Unset, the rate is ``DEFAULT_RATE``; 0 traces every root. An ``OTEL_TRACES_SAMPLER``
other than those two (always_off, a custom one) is the operator's choice and is left
alone."""

import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from opentelemetry.context import Context
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_ON,
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import Link, SpanKind, get_current_span
from opentelemetry.trace.span import TraceState
from opentelemetry.util.types import Attributes

RATE_ENV = "PERIGEE_TRACE_RATE"
DEFAULT_RATE = 50.0  # traces a second a process exports, the variable unset
# In the tracestate of a trace recorded but not exported: its spans are recorded too.
MARK_KEY, MARK = "perigee", "r"
# The samplers whose ratio the bucket keeps beneath it.
RATIO_SAMPLERS = ("parentbased_traceidratio", "traceidratio")


class RateLimited(Sampler):
    """``inner``'s sampled roots, at most ``per_s`` a second (a bucket of ``per_s``)."""

    def __init__(
        self,
        per_s: float,
        inner: Sampler = ALWAYS_ON,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if per_s <= 0:
            raise ValueError("per_s must be positive")
        self.per_s, self.inner, self.clock = per_s, inner, clock
        self.capacity = max(1.0, per_s)
        self._tokens = self.capacity
        self._last = clock()
        self._lock = threading.Lock()  # spans start in executor threads too

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: TraceState | None = None,
    ) -> SamplingResult:
        result = self.inner.should_sample(
            parent_context, trace_id, name, kind, attributes, links, trace_state
        )
        if result.decision != Decision.RECORD_AND_SAMPLE:
            return result
        with self._lock:
            now = self.clock()
            self._tokens = min(self.capacity, self._tokens + (now - self._last) * self.per_s)
            self._last = now
            if self._tokens < 1.0:
                marked = (result.trace_state or TraceState()).add(MARK_KEY, MARK)
                return SamplingResult(Decision.RECORD_ONLY, attributes, marked)
            self._tokens -= 1.0
        return result

    def get_description(self) -> str:
        return f"RateLimited{{{self.per_s:g}/s, {self.inner.get_description()}}}"


class RecordMarked(Sampler):
    """Under a parent that is not sampled: record a span whose trace the bucket marked
    (recorded, not exported), drop any other."""

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: TraceState | None = None,
    ) -> SamplingResult:
        state = get_current_span(parent_context).get_span_context().trace_state
        if state is not None and state.get(MARK_KEY) == MARK:
            return SamplingResult(Decision.RECORD_ONLY, attributes, state)
        return SamplingResult(Decision.DROP, None, state)

    def get_description(self) -> str:
        return "RecordMarked"


def rate_limited(
    per_s: float, inner: Sampler = ALWAYS_ON, clock: Callable[[], float] = time.monotonic
) -> Sampler:
    """Roots through the bucket; children follow, recorded when their trace is marked."""
    follow = RecordMarked()
    return ParentBased(
        root=RateLimited(per_s, inner, clock),
        remote_parent_not_sampled=follow,
        local_parent_not_sampled=follow,
    )


def sampler_from_env(env: Mapping[str, str] | None = None) -> Sampler | None:
    """The sampler ``PERIGEE_TRACE_RATE`` asks for, or None (the SDK's own from the
    ``OTEL_TRACES_SAMPLER`` variables)."""
    env = os.environ if env is None else env
    raw = (env.get(RATE_ENV) or "").strip()
    rate = float(raw) if raw else DEFAULT_RATE
    name = (env.get("OTEL_TRACES_SAMPLER") or "").strip().lower()
    if rate <= 0 or (name and name not in RATIO_SAMPLERS):
        return None
    inner: Sampler = ALWAYS_ON
    if name:
        arg = (env.get("OTEL_TRACES_SAMPLER_ARG") or "").strip()
        inner = TraceIdRatioBased(float(arg) if arg else 1.0)
    return rate_limited(rate, inner)
