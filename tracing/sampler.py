"""How many requests are traced: at most so many new traces a second at each root.

A trace starts where a request enters (the gateway; admission for a client on the bus)
and every service downstream follows that decision from the W3C context it is handed
(``ParentBased``), so a traced request is traced whole and an untraced one costs no
span anywhere. Making spans is what tracing costs (about 15 % of the CPU of a request
through the mock stack, BENCHMARKS.md), so a fixed share would charge a busy stack more
the busier it gets. The root's :class:`RateLimitedSampler` is a token bucket instead:
below ``rate`` requests a second every request is traced; above it, ``rate`` a second
are, and the share falls as the load rises (Jaeger's rate-limiting sampler;
``--trace-rate 0`` traces every request, for a ``perigee breakdown`` of each). The
stage histograms fed by spans (services.common.metrics.SpanMetrics) then count the
traced requests only.

``PERIGEE_TRACE_RATE`` sets it (traces a second, default :data:`DEFAULT_RATE`; 0: no
cap, every request). The standard ``OTEL_TRACES_SAMPLER`` wins when set (``perigee up
--trace-sample`` sets it to ``parentbased_traceidratio``)."""

import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from opentelemetry.context import Context
from opentelemetry.sdk.trace.sampling import (
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
)
from opentelemetry.trace import Link, SpanKind, get_current_span
from opentelemetry.trace.span import TraceState
from opentelemetry.util.types import Attributes

ENV = "PERIGEE_TRACE_RATE"
# New traces a second at each root. Low, as production tracers sample (Jaeger's
# rate limiter; vLLM and Dynamo trace nothing unless asked): a traced request costs
# about 1.8 ms more CPU through the mock stack on 2 cores and 0.7-1 ms more to its
# first token, so tracing every request at 50 req/s put the control plane's p50 past
# 8 paced bus round trips (BENCHMARKS.md, capacity, session 26).
DEFAULT_RATE = 5.0


class RateLimitedSampler(Sampler):
    """Samples at most ``rate`` new traces a second, in bursts of up to ``burst``
    (default: one second's worth); ``clock`` is monotonic seconds."""

    def __init__(
        self, rate: float, burst: float | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if rate <= 0:
            raise ValueError(f"rate {rate}: traces a second must be positive")
        self.rate = rate
        self.burst = max(1.0, rate if burst is None else burst)
        self._clock = clock
        self._tokens = self.burst
        self._last = clock()
        self._lock = threading.Lock()  # spans may start on exporter or executor threads

    def take(self) -> bool:
        """One trace's token, if the bucket has one."""
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            if self._tokens < 1.0:
                return False
            self._tokens -= 1.0
            return True

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
        parent = get_current_span(parent_context).get_span_context()
        state = parent.trace_state if parent.is_valid else None
        if self.take():
            return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes, state)
        return SamplingResult(Decision.DROP, None, state)

    def get_description(self) -> str:
        return f"RateLimitedSampler{{{self.rate:g}/s}}"


def rate_from_env(env: Mapping[str, str] | None = None) -> float:
    """``PERIGEE_TRACE_RATE`` (default :data:`DEFAULT_RATE`); ValueError when it is not
    a number of at least 0."""
    env = os.environ if env is None else env
    raw = (env.get(ENV) or "").strip()
    if not raw:
        return DEFAULT_RATE
    rate = float(raw)
    if not rate >= 0:  # NaN too
        raise ValueError(f"{ENV}={raw!r}: traces a second, at least 0")
    return rate


def sampler_from_env(env: Mapping[str, str] | None = None) -> Sampler | None:
    """The sampler a process's provider takes: None (the SDK's own choice from
    ``OTEL_TRACES_SAMPLER``, or every request) when that variable is set or the rate is
    0; else the root's bucket, followed downstream."""
    env = os.environ if env is None else env
    if env.get("OTEL_TRACES_SAMPLER"):
        return None
    rate = rate_from_env(env)
    return ParentBased(root=RateLimitedSampler(rate)) if rate > 0 else None
