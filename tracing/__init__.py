"""OpenTelemetry for perigee: one tracer provider per process, W3C trace context
carried in NATS headers and ZeroMQ header frames.

The exporter follows the standard variables: ``OTEL_TRACES_EXPORTER`` = ``jsonl``
(default: one span per line in ``PERIGEE_SPANS_FILE``, default
``.perigee/spans.jsonl``), ``otlp`` (``OTEL_EXPORTER_OTLP_ENDPOINT``…), ``console``
or ``none``. ``OTEL_SERVICE_NAME`` overrides the service name.
"""

from tracing.propagation import extract, inject
from tracing.setup import setup_tracing, shutdown_tracing, tracer

__all__ = ["setup_tracing", "shutdown_tracing", "tracer", "inject", "extract"]
