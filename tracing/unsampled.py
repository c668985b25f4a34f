"""Spans of untraced requests are not made.

Under a parent-based sampler (perigee's default, and every ``parentbased_*`` choice of
``OTEL_TRACES_SAMPLER``), a span whose parent is not sampled is dropped. The SDK still
builds it (a non-recording span with an id of its own) and makes it current: 5-6 us a
span warm, about twenty a request across the services, for most requests once the
root's rate is reached (tracing.sampler). :class:`SkipUnsampled` wraps a tracer and
hands back the parent's own non-recording span instead, with the parent's context
current, so what is propagated onwards says "not sampled" as before. Nothing records
either span, so nothing else differs. A span under a sampled parent, or at a root, goes
to the SDK as before; so does every span when the sampler is not parent-based (an
``always_on`` sampler records children of unsampled parents).
"""

import contextlib
from collections.abc import Iterator
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace.sampling import Sampler

_NOT_SAMPLED_OFF = (
    "remoteParentNotSampled:AlwaysOffSampler",
    "localParentNotSampled:AlwaysOffSampler",
)


def parent_decides(sampler: Sampler) -> bool:
    """Whether ``sampler`` drops every span whose parent is not sampled."""
    d = sampler.get_description()
    return d.startswith("ParentBased{") and all(part in d for part in _NOT_SAMPLED_OFF)


_decided: tuple[object, bool] = (None, False)  # (tracer provider, its sampler's verdict)


def _skips(provider: object) -> bool:
    global _decided
    if _decided[0] is not provider:
        sampler = getattr(provider, "sampler", None)  # the SDK's provider has one
        _decided = (provider, isinstance(sampler, Sampler) and parent_decides(sampler))
    return _decided[1]


def _unsampled_parent(context: otel_context.Context | None) -> trace.Span | None:
    parent = trace.get_current_span(context)
    sc = parent.get_span_context()
    return parent if sc.is_valid and not sc.trace_flags.sampled else None


class SkipUnsampled(trace.Tracer):
    """``inner``, less the spans a parent-based sampler would drop (see the module);
    ``provider``: whose sampler decides (default: the global one, as it is then)."""

    def __init__(self, inner: trace.Tracer, provider: object = None) -> None:
        self._inner = inner
        self._provider = provider

    def _parent_to_reuse(self, context: Any) -> trace.Span | None:
        provider = self._provider or trace.get_tracer_provider()
        return _unsampled_parent(context) if _skips(provider) else None

    def start_span(self, name: str, context: Any = None, *args: Any, **kwargs: Any) -> trace.Span:
        if (parent := self._parent_to_reuse(context)) is not None:
            return parent
        return self._inner.start_span(name, context, *args, **kwargs)

    @contextlib.contextmanager
    def start_as_current_span(
        self, name: str, context: Any = None, *args: Any, **kwargs: Any
    ) -> Iterator[trace.Span]:
        parent = self._parent_to_reuse(context)
        if parent is None:
            with self._inner.start_as_current_span(name, context, *args, **kwargs) as span:
                yield span
            return
        if context is None:  # the parent is current already
            yield parent
            return
        token = otel_context.attach(context)
        try:
            yield parent
        finally:
            otel_context.detach(token)
