"""tracing.unsampled: under a parent-based sampler the span of an untraced request is not
made (its parent's stands in, its context propagated unchanged); a traced request's
spans, roots, and every span under a sampler that is not parent-based are made as
before."""

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased, TraceIdRatioBased
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from tracing.propagation import extract, inject
from tracing.sampler import RateLimitedSampler
from tracing.unsampled import SkipUnsampled, parent_decides

UNSAMPLED = "00-0000000000000000000000000000abcd-00000000000000ef-00"
SAMPLED = "00-0000000000000000000000000000abcd-00000000000000ef-01"


def rig(sampler) -> tuple[SkipUnsampled, InMemorySpanExporter]:
    provider = TracerProvider(sampler=sampler)
    spans = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    return SkipUnsampled(provider.get_tracer("t"), provider), spans


def test_which_samplers_leave_an_unsampled_parents_spans_undone():
    assert parent_decides(ParentBased(root=RateLimitedSampler(50.0)))  # perigee's default
    assert parent_decides(ParentBased(ALWAYS_ON))  # the SDK's default
    assert parent_decides(ParentBased(TraceIdRatioBased(0.1)))  # --trace-sample
    assert not parent_decides(ALWAYS_ON)
    assert not parent_decides(ParentBased(ALWAYS_ON, remote_parent_not_sampled=ALWAYS_ON))


def test_a_consumer_span_of_an_untraced_request_is_its_parents():
    t, spans = rig(ParentBased(root=RateLimitedSampler(50.0)))
    ctx = extract({"traceparent": UNSAMPLED})
    with t.start_as_current_span("svc.handle", context=ctx, kind=trace.SpanKind.CONSUMER) as s:
        sc = s.get_span_context()
        assert not s.is_recording()
        assert (sc.trace_id, sc.span_id) == (0xABCD, 0xEF)  # the parent's, no span of its own
        assert trace.get_current_span() is s  # the parent's context is current
        with t.start_as_current_span("svc.step") as inner:  # nested: the same span again
            assert inner is s
            assert inject()["traceparent"] == UNSAMPLED  # onwards: still not sampled
        assert t.start_span("svc.later") is s
    assert trace.get_current_span() is not s  # detached on the way out
    assert spans.get_finished_spans() == ()


def test_an_exception_under_an_untraced_span_still_propagates_and_detaches():
    t, _ = rig(ParentBased(ALWAYS_ON))
    ctx = extract({"traceparent": UNSAMPLED})
    with pytest.raises(ValueError, match="boom"):
        with t.start_as_current_span("svc.handle", context=ctx):
            raise ValueError("boom")
    assert not trace.get_current_span().get_span_context().is_valid


def test_traced_requests_and_roots_get_their_spans():
    t, spans = rig(ParentBased(ALWAYS_ON))
    with t.start_as_current_span("svc.handle", context=extract({"traceparent": SAMPLED})) as s:
        assert s.is_recording() and s.get_span_context().span_id != 0xEF
        with t.start_as_current_span("svc.step") as inner:
            assert inner.is_recording() and inner is not s
        t.start_span("svc.later").end()
    with t.start_as_current_span("root") as r:  # no parent: the sampler's root decides
        assert r.is_recording()
    names = [x.name for x in spans.get_finished_spans()]
    assert names == ["svc.step", "svc.later", "svc.handle", "root"]


def test_a_sampler_that_is_not_parent_based_records_under_unsampled_parents():
    t, spans = rig(ALWAYS_ON)
    with t.start_as_current_span("svc.handle", context=extract({"traceparent": UNSAMPLED})) as s:
        assert s.is_recording() and s.get_span_context().span_id != 0xEF
    parent = NonRecordingSpan(SpanContext(0xABCD, 0xEF, False, TraceFlags(0)))
    t.start_span("svc.later", context=trace.set_span_in_context(parent)).end()
    assert [x.name for x in spans.get_finished_spans()] == ["svc.handle", "svc.later"]
