"""OpenTelemetry for perigee: one tracer provider per process, W3C trace context
carried in NATS headers (:func:`services.common.bus.publish`) and in the ZeroMQ
data-plane headers (``trace`` of :mod:`services.transfer.wire` requests).

The exporters follow the standard variables (see :mod:`tracing.setup`):
``OTEL_TRACES_EXPORTER`` = ``jsonl`` (default: one span per line in
``PERIGEE_SPANS_FILE``, default ``.perigee/spans.jsonl``), ``otlp``
(``OTEL_EXPORTER_OTLP_*``, http/protobuf by default), ``console`` or ``none``,
comma-separated for several. ``OTEL_SERVICE_NAME`` overrides the service name.

A request is one trace across every service; its spans (names in
:mod:`perigee.breakdown`) cover scheduling and queueing, prefix load, prefill
compute, KV transfer, decode-side load, first token and decode.
"""

from tracing.propagation import extract, inject
from tracing.setup import add_span_processor, setup_tracing, shutdown_tracing, tracer

__all__ = ["setup_tracing", "shutdown_tracing", "tracer", "inject", "extract", "add_span_processor"]
