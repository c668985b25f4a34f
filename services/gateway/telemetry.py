"""What the gateway records about a finished request: span attributes (OpenTelemetry
GenAI semantic conventions), Prometheus metrics (vLLM's names, ``perigee:`` prefix)
and one log line.

TTFT is measured from the moment the request reached the gateway to the first
``Tokens`` event (the span gets a ``first_token`` event then); inter-token latency from
one ``Tokens`` event to the next, divided over the tokens it carried. Latency
histograms count every request that produced a token; token counters and
``request_success`` only requests answered 200.
"""

import time

import structlog
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from services.common import metrics as m
from services.gateway.responses import RequestOutcome

log = structlog.get_logger()


def request_attributes(
    *,
    chat: bool,
    model: str,
    max_tokens: int,
    temperature: float,
    top_p: float,
    seed: int | None,
    stop: list[str],
    request_id: str,
    prompt_tokens: int,
) -> dict:
    attrs = {
        "gen_ai.operation.name": "chat" if chat else "text_completion",
        "gen_ai.system": "perigee",
        "gen_ai.request.model": model,
        "gen_ai.request.max_tokens": max_tokens,
        "gen_ai.request.temperature": temperature,
        "gen_ai.request.top_p": top_p,
        "gen_ai.response.id": request_id,
        "gen_ai.usage.input_tokens": prompt_tokens,
    }
    if seed is not None:
        attrs["gen_ai.request.seed"] = seed
    if stop:
        attrs["gen_ai.request.stop_sequences"] = list(stop)
    return attrs


def rejected(model: str, status: int) -> None:
    """A request refused before it reached the bus (400, 401, 404, 413)."""
    m.REQUEST_ERRORS.labels(model_name=model, status=str(status)).inc()


def finish(span: trace.Span, out: RequestOutcome, t0: float, model: str) -> None:
    e2e = time.perf_counter() - t0
    span.set_attribute("gen_ai.response.model", model)
    span.set_attribute("gen_ai.usage.input_tokens", out.prompt_tokens)
    span.set_attribute("gen_ai.usage.output_tokens", out.completion_tokens)
    span.set_attribute("http.response.status_code", out.status)
    if out.finish:
        span.set_attribute("gen_ai.response.finish_reasons", [out.finish])
    span.set_attribute("perigee.cached_tokens", out.cached_tokens)
    if out.decode:
        span.set_attribute("perigee.prefill_instance", out.prefill)
        span.set_attribute("perigee.decode_instance", out.decode)
    if out.ttft_s is not None:
        span.set_attribute("perigee.ttft_s", out.ttft_s)
    if out.status >= 400:
        span.set_status(Status(StatusCode.ERROR, out.error))
    observe(out, e2e, model)
    log.info(
        "request_done",
        status=out.status,
        finish_reason=out.finish or None,
        prompt_tokens=out.prompt_tokens,
        completion_tokens=out.completion_tokens,
        cached_tokens=out.cached_tokens,
        prefill=out.prefill or None,
        decode=out.decode or None,
        ttft_ms=None if out.ttft_s is None else round(out.ttft_s * 1e3, 3),
        e2e_ms=round(e2e * 1e3, 3),
        error=out.error or None,
    )


def observe(out: RequestOutcome, e2e_s: float, model: str) -> None:
    """The Prometheus side of :func:`finish`."""
    labels = {"model_name": model}
    if out.max_tokens:
        m.REQUEST_MAX_TOKENS.labels(**labels).observe(out.max_tokens)
    if out.ttft_s is not None:
        m.TTFT.labels(**labels).observe(out.ttft_s)
        itl = m.ITL.labels(**labels)
        for gap, k in out.itl:
            for _ in range(k):
                itl.observe(gap)
    if out.status >= 400:
        rejected(model, out.status)
        return
    m.E2E.labels(**labels).observe(e2e_s)
    m.REQUEST_SUCCESS.labels(model_name=model, finished_reason=out.finish or "unknown").inc()
    m.PROMPT_TOKENS.labels(**labels).inc(out.prompt_tokens)
    m.GENERATION_TOKENS.labels(**labels).inc(out.completion_tokens)
    m.REQUEST_PROMPT_TOKENS.labels(**labels).observe(out.prompt_tokens)
    m.REQUEST_GENERATION_TOKENS.labels(**labels).observe(out.completion_tokens)
    if out.ttft_s is not None and out.completion_tokens > 1:
        m.TPOT.labels(**labels).observe((e2e_s - out.ttft_s) / (out.completion_tokens - 1))
