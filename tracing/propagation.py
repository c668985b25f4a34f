"""W3C trace context in and out of NATS headers (a dict) and ZMQ header frames."""

from opentelemetry import context as otel_context
from opentelemetry.propagate import extract as _extract
from opentelemetry.propagate import inject as _inject


def inject(headers: dict[str, str] | None = None) -> dict[str, str]:
    """Headers carrying the current span's context (``traceparent``/``tracestate``)."""
    headers = dict(headers or {})
    _inject(headers)
    return headers


def extract(headers: dict[str, str] | None) -> otel_context.Context:
    return _extract(headers or {})
