"""tracing.setup: exporters chosen by OTEL_* variables; OTLP over http/protobuf really
delivers spans (to a local receiver); the JSONL exporter keeps span events."""

import http.server
import json
import threading

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

import tracing.setup as tracing_setup
from tracing.jsonl import JsonlSpanExporter
from tracing.setup import (
    DEFAULT_SPANS_FILE,
    TracingConfigError,
    exporter_kinds,
    make_exporter,
    otlp_protocol,
    span_processors,
)


def test_exporter_selection():
    assert exporter_kinds({}) == ["jsonl"]
    assert exporter_kinds({"OTEL_TRACES_EXPORTER": "otlp, jsonl"}) == ["otlp", "jsonl"]
    j = make_exporter("jsonl", {})
    assert isinstance(j, JsonlSpanExporter) and j.path == DEFAULT_SPANS_FILE
    assert make_exporter("jsonl", {"PERIGEE_SPANS_FILE": "/tmp/x/s.jsonl"}).path == "/tmp/x/s.jsonl"
    assert isinstance(make_exporter("console", {}), ConsoleSpanExporter)
    assert make_exporter("none", {}) is None
    assert span_processors({"OTEL_TRACES_EXPORTER": "none"}) == []
    assert len(span_processors({"OTEL_TRACES_EXPORTER": "console,none"})) == 1
    with pytest.raises(TracingConfigError):
        make_exporter("zipkin", {})


def test_otlp_protocol_defaults_to_http_protobuf():
    assert otlp_protocol({}) == "http/protobuf"
    assert otlp_protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}) == "grpc"
    assert (
        otlp_protocol(
            {
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
            }
        )
        == "http/protobuf"
    )
    assert isinstance(make_exporter("otlp", {}), OTLPSpanExporter)


class _Receiver(http.server.BaseHTTPRequestHandler):
    received: list[tuple[str, dict, bytes]] = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).received.append(
            (self.path, {k.lower(): v for k, v in self.headers.items()}, body)
        )
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()
        self.wfile.write(b"")

    def log_message(self, *a):
        pass


def test_otlp_http_protobuf_exports_spans(monkeypatch):
    srv = http.server.HTTPServer(("127.0.0.1", 0), _Receiver)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{srv.server_port}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-tenant=perigee")
        monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL", raising=False)
        monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
        exporter = make_exporter("otlp")
        provider = TracerProvider(resource=Resource.create({"service.name": "unit-gw"}))
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        with provider.get_tracer("t").start_as_current_span(
            "gateway.request", attributes={"gen_ai.system": "perigee"}
        ) as span:
            span.add_event("first_token")
        provider.shutdown()
    finally:
        srv.shutdown()
        srv.server_close()
    [(path, headers, body)] = _Receiver.received
    assert path == "/v1/traces"
    assert headers["content-type"] == "application/x-protobuf"
    assert headers["x-tenant"] == "perigee"
    req = ExportTraceServiceRequest.FromString(body)
    [rs] = req.resource_spans
    svc = {a.key: a.value.string_value for a in rs.resource.attributes}["service.name"]
    [ss] = rs.scope_spans
    [s] = ss.spans
    assert (svc, s.name, [e.name for e in s.events]) == (
        "unit-gw",
        "gateway.request",
        ["first_token"],
    )
    assert {a.key: a.value.string_value for a in s.attributes} == {"gen_ai.system": "perigee"}


def test_jsonl_keeps_kind_and_events(tmp_path):
    path = tmp_path / "d" / "spans.jsonl"
    provider = TracerProvider(resource=Resource.create({"service.name": "svc"}))
    provider.add_span_processor(SimpleSpanProcessor(JsonlSpanExporter(str(path))))
    tr = provider.get_tracer("t")
    with tr.start_as_current_span(
        "outer", attributes={"gen_ai.response.finish_reasons": ["stop"]}
    ) as s:
        s.add_event("first_token", {"n": 1})
        with tr.start_as_current_span("inner"):
            pass
    provider.shutdown()
    inner, outer = (json.loads(x) for x in path.read_text().splitlines())
    assert (inner["name"], outer["name"]) == ("inner", "outer")
    assert inner["parent_id"] == outer["span_id"] and inner["trace_id"] == outer["trace_id"]
    assert outer["service"] == "svc" and outer["kind"] == "INTERNAL"
    assert outer["attributes"] == {"gen_ai.response.finish_reasons": ["stop"]}
    [ev] = outer["events"]
    assert (ev["name"], ev["attributes"]) == ("first_token", {"n": 1})
    assert outer["start_ns"] <= ev["ts_ns"] <= outer["end_ns"]
    assert "events" not in inner


def test_a_sampled_share_is_decided_at_the_root_and_followed_downstream(monkeypatch):
    """perigee up --trace-sample: the environment perigee.stack.sampling_env gives every
    service makes OpenTelemetry decide at a trace's root, and a service downstream,
    handed the root's context through our headers (tracing.propagation), follows that
    decision: a traced request is traced whole, an untraced one nowhere."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from perigee.stack import sampling_env
    from tracing.propagation import extract, inject

    for k, v in sampling_env(0.5).items():
        monkeypatch.setenv(k, v)
    gateway, downstream = InMemorySpanExporter(), InMemorySpanExporter()
    pa, pb = TracerProvider(), TracerProvider()  # each reads the sampler from the env
    pa.add_span_processor(SimpleSpanProcessor(gateway))
    pb.add_span_processor(SimpleSpanProcessor(downstream))
    ta, tb = pa.get_tracer("gateway"), pb.get_tracer("prefill")
    traced = []
    for _ in range(200):
        with ta.start_as_current_span("gateway.request") as root:
            headers = inject()
        child = tb.start_span("prefill.compute", context=extract(headers))
        child.end()
        assert child.get_span_context().trace_id == root.get_span_context().trace_id
        traced.append(root.get_span_context().trace_flags.sampled)
        assert child.get_span_context().trace_flags.sampled == traced[-1]
    assert 0 < sum(traced) < 200  # a share, not all or none (each 2^-200 by chance)
    roots = {s.context.trace_id for s in gateway.get_finished_spans()}
    children = {s.context.trace_id for s in downstream.get_finished_spans()}
    assert roots == children and len(roots) == sum(traced)


def test_the_root_traces_at_most_its_rate_and_every_service_follows(monkeypatch):
    """The default (tracing.sampler): a root traces every request while its bucket holds
    a token (a second's worth, refilled at the rate) and none past it; a service
    downstream follows the root's decision either way, so a request is traced whole or
    nowhere. The clock is the test's."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tracing.propagation import extract, inject
    from tracing.sampler import ParentBased, RateLimitedSampler

    now = [100.0]
    root = RateLimitedSampler(4.0, clock=lambda: now[0])
    gateway, downstream = InMemorySpanExporter(), InMemorySpanExporter()
    pa = TracerProvider(sampler=ParentBased(root=root))
    pb = TracerProvider(sampler=ParentBased(root=RateLimitedSampler(1.0, burst=1.0)))
    pa.add_span_processor(SimpleSpanProcessor(gateway))
    pb.add_span_processor(SimpleSpanProcessor(downstream))
    ta, tb = pa.get_tracer("gateway"), pb.get_tracer("prefill")

    def request() -> bool:
        with ta.start_as_current_span("gateway.request") as span:
            headers = inject()
        for _ in range(3):  # more than the downstream bucket's own: it is not consulted
            tb.start_span("prefill.compute", context=extract(headers)).end()
        return span.get_span_context().trace_flags.sampled

    assert [request() for _ in range(6)] == [True] * 4 + [False] * 2  # the burst: 4
    now[0] += 0.25  # one token back
    assert [request() for _ in range(2)] == [True, False]
    now[0] += 10.0  # the bucket holds a second's worth at most
    assert [request() for _ in range(5)] == [True] * 4 + [False]
    roots = [s.context.trace_id for s in gateway.get_finished_spans()]
    children = [s.context.trace_id for s in downstream.get_finished_spans()]
    assert len(roots) == 9 and children == [t for t in roots for _ in range(3)]


def test_the_rate_comes_from_the_environment_and_the_standard_variable_wins(monkeypatch):
    from perigee.stack import sampling_env
    from tracing.sampler import DEFAULT_RATE, RateLimitedSampler, sampler_from_env

    assert sampling_env(1.0) == {"PERIGEE_TRACE_RATE": f"{DEFAULT_RATE:g}"}
    assert sampling_env(1.0, 0.0) == {"PERIGEE_TRACE_RATE": "0"}
    assert "PERIGEE_TRACE_RATE" not in sampling_env(0.5, 7.0)  # the share decides
    default = sampler_from_env({})
    assert isinstance(default._root, RateLimitedSampler) and default._root.rate == DEFAULT_RATE
    assert sampler_from_env({"PERIGEE_TRACE_RATE": "12.5"})._root.rate == 12.5
    assert sampler_from_env({"PERIGEE_TRACE_RATE": "0"}) is None  # every request
    ratio = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "PERIGEE_TRACE_RATE": "5"}
    assert sampler_from_env(ratio) is None  # the SDK reads the standard variable
    for bad in ("-1", "nan", "fast"):
        with pytest.raises(ValueError):
            sampler_from_env({"PERIGEE_TRACE_RATE": bad})
    monkeypatch.setenv("PERIGEE_TRACE_RATE", "-1")
    monkeypatch.setattr(tracing_setup, "_provider", None)
    with pytest.raises(tracing_setup.TracingConfigError, match="PERIGEE_TRACE_RATE"):
        tracing_setup.setup_tracing("svc")
