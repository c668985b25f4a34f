import os

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

from tracing.jsonl import JsonlSpanExporter

DEFAULT_SPANS_FILE = ".perigee/spans.jsonl"

_provider: TracerProvider | None = None


def _exporter(kind: str):
    if kind == "otlp":
        protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
            "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"
        )
        if protocol.startswith("http"):
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        return OTLPSpanExporter()
    if kind == "console":
        return ConsoleSpanExporter()
    return JsonlSpanExporter(os.environ.get("PERIGEE_SPANS_FILE", DEFAULT_SPANS_FILE))


def setup_tracing(service: str) -> None:
    global _provider
    if _provider is not None:
        return
    kind = os.environ.get("OTEL_TRACES_EXPORTER", "jsonl").split(",")[0].strip().lower()
    name = os.environ.get("OTEL_SERVICE_NAME", service)
    _provider = TracerProvider(resource=Resource.create({"service.name": name}))
    if kind != "none":
        _provider.add_span_processor(BatchSpanProcessor(_exporter(kind)))
    trace.set_tracer_provider(_provider)


def shutdown_tracing() -> None:
    if _provider is not None:
        _provider.shutdown()


def tracer(name: str = "perigee") -> trace.Tracer:
    return trace.get_tracer(name)
