"""One tracer provider per process, its exporters chosen by the standard variables.

``OTEL_TRACES_EXPORTER`` is a comma list of:

* ``jsonl`` (default): one span per line appended to ``PERIGEE_SPANS_FILE``
  (default ``.perigee/spans.jsonl``); what ``perigee breakdown`` reads;
* ``otlp``: the OTLP exporter, configured by ``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT``,
  ``..._HEADERS``, ``..._TIMEOUT`` and ``..._PROTOCOL``: ``http/protobuf`` (the
  default, ``opentelemetry-exporter-otlp-proto-http`` is a dependency) or ``grpc``
  (needs ``opentelemetry-exporter-otlp-proto-grpc`` installed);
* ``console``; ``none`` (spans are made, e.g. for span metrics, but not exported).

Which requests are traced: :mod:`tracing.sampler` (at most ``PERIGEE_TRACE_RATE`` new
traces a second at each root, or the standard ``OTEL_TRACES_SAMPLER``).
``OTEL_SERVICE_NAME`` overrides the service name and ``OTEL_RESOURCE_ATTRIBUTES``
adds resource attributes; the batch processor reads ``OTEL_BSP_*``.
"""

import os

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

from tracing.jsonl import JsonlSpanExporter
from tracing.sampler import sampler_from_env
from tracing.unsampled import SkipUnsampled

DEFAULT_SPANS_FILE = ".perigee/spans.jsonl"
EXPORTERS = ("jsonl", "otlp", "console", "none")

_provider: TracerProvider | None = None


class TracingConfigError(ValueError):
    """An OTEL_* variable asks for something this installation cannot do."""


def otlp_protocol(env: dict[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    return (
        (
            env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            or "http/protobuf"
        )
        .strip()
        .lower()
    )


def make_exporter(kind: str, env: dict[str, str] | None = None) -> SpanExporter | None:
    """The exporter for one ``OTEL_TRACES_EXPORTER`` entry (None for ``none``)."""
    env = os.environ if env is None else env
    if kind == "none":
        return None
    if kind == "otlp":
        protocol = otlp_protocol(env)
        if protocol == "grpc":
            try:
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            except ImportError as e:
                raise TracingConfigError(
                    "OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs opentelemetry-exporter-otlp-proto-grpc; "
                    "install it or use http/protobuf"
                ) from e
            return OTLPSpanExporter()
        if protocol not in ("http/protobuf", "http"):
            raise TracingConfigError(
                f"unsupported OTLP protocol {protocol!r} (http/protobuf or grpc)"
            )
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if kind == "console":
        return ConsoleSpanExporter()
    if kind == "jsonl":
        return JsonlSpanExporter(env.get("PERIGEE_SPANS_FILE") or DEFAULT_SPANS_FILE)
    raise TracingConfigError(
        f"OTEL_TRACES_EXPORTER={kind!r}: expected one of {', '.join(EXPORTERS)}"
    )


def exporter_kinds(env: dict[str, str] | None = None) -> list[str]:
    env = os.environ if env is None else env
    raw = env.get("OTEL_TRACES_EXPORTER") or "jsonl"
    kinds = [k.strip().lower() for k in raw.split(",") if k.strip()]
    return kinds or ["jsonl"]


def span_processors(env: dict[str, str] | None = None) -> list[SpanProcessor]:
    """One batch processor per configured exporter."""
    out: list[SpanProcessor] = []
    for kind in exporter_kinds(env):
        exporter = make_exporter(kind, env)
        if exporter is not None:
            out.append(BatchSpanProcessor(exporter))
    return out


def setup_tracing(service: str) -> TracerProvider:
    """Install this process's tracer provider (once; later calls return it)."""
    global _provider
    if _provider is not None:
        return _provider
    name = os.environ.get("OTEL_SERVICE_NAME") or service
    try:
        sampler = sampler_from_env()
    except ValueError as e:
        raise TracingConfigError(str(e)) from e
    provider = TracerProvider(resource=Resource.create({"service.name": name}), sampler=sampler)
    for p in span_processors():
        provider.add_span_processor(p)
    trace.set_tracer_provider(provider)
    _provider = provider
    return provider


def add_span_processor(processor: SpanProcessor) -> bool:
    """Attach ``processor`` (e.g. span metrics) to this process's provider, if set up."""
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.add_span_processor(processor)
        return True
    return False


def shutdown_tracing() -> None:
    if _provider is not None:
        _provider.shutdown()


_tracers: dict[str, trace.Tracer] = {}


def tracer(name: str = "perigee") -> trace.Tracer:
    # get_tracer builds a new Tracer per call (tens of microseconds, several per hop).
    # Caching is safe: before setup it is a proxy that follows the provider once set.
    t = _tracers.get(name)
    if t is None:
        t = _tracers[name] = SkipUnsampled(trace.get_tracer(name))
    return t
