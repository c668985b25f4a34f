"""Prometheus metrics of every perigee service, named the way vLLM names its own
(``vllm:time_to_first_token_seconds`` -> ``perigee:time_to_first_token_seconds``).

One registry per process (:data:`REGISTRY`). Metric objects are defined here once;
a service registers the groups it updates with :func:`setup` (so a store does not
export an empty TTFT histogram), plus collectors that read its state at scrape time.
Counters are exported with ``_total`` (prometheus_client adds it, as for vLLM).

=====================  ==================================================================
service                metrics
=====================  ==================================================================
gateway (model_name)   time_to_first_token_seconds, inter_token_latency_seconds,
                       request_time_per_output_token_seconds, e2e_request_latency_seconds
                       (histograms); request_prompt_tokens, request_generation_tokens,
                       request_params_max_tokens (histograms); prompt_tokens,
                       generation_tokens, request_success{finished_reason},
                       request_errors{status} (counters); gateway_requests_in_flight;
                       state_entries{map}, intake_bypasses{hop},
                       instance_restarts_seen, requests_wedged, cancels_unacknowledged
admission              requests_admitted; requests_rejected{service,code,reason};
                       state_entries{map}, intake_bypasses{hop}
conductor              requests_rejected{...}; state_entries{map}, intake_bypasses{hop};
                       request_scheduling_time_seconds (span
                       conductor.place); conductor_<policy stat> counters;
                       conductor_pending_requests; migrations{reason}
prefill                num_requests_waiting, num_requests_running, prefill_queued_tokens;
                       prefix_cache_queries, prefix_cache_hits, prefix_cache_remote_hits
                       (tokens); prefill_<counter>; request_queue_time_seconds,
                       request_prefix_load_time_seconds, request_prefill_time_seconds,
                       kv_transfer_time_seconds (spans);
                       prefill_time_predicted_over_measured (calibration)
decode                 num_requests_running, num_requests_waiting, decode_kv_tokens,
                       decode_step_time_seconds; decode_<counter> (write-back:
                       decode_writeback_{blocks,followed_blocks,txs,failed,broken}_total);
                       migration_kv_tokens{kind=pulled|recomputed};
                       request_decode_load_time_seconds, request_decode_time_seconds
store                  store_bytes{tier}, store_capacity_bytes{tier}, kv_cache_usage_perc,
                       store_blocks{state}, store_<gauge> (open_txs, ...);
                       transfer_bytes{direction}, kv_transfer_bytes{transport},
                       transfer_errors{kind},
                       transfer_requests{op}, transfer_blocks{direction}; store_<counter>
                       (decode write-back: store_answer_blocks, hits on those blocks
                       store_answer_hits_{vram,dram,ssd});
                       store_transfer_time_seconds{op} (spans)
=====================  ==================================================================

Stage histograms come from spans (:class:`SpanMetrics`, a span processor): the
span that times a stage for the trace also times it for Prometheus.

Services other than the gateway serve ``/metrics`` on ``--metrics-port`` (0: off),
with the ``/health`` and ``/ready`` probes beside it, by :func:`serve_metrics`, an
aiohttp server on the service's own event loop, so collectors read the service's state
on the thread that changes it.
"""

import argparse
import re
from collections.abc import Callable, Iterable
from typing import Any

import prometheus_client
from aiohttp import web
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.trace import StatusCode
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.registry import Collector

from bus_schemas.roles import Role
from services.common.metric_collectors import (  # noqa: F401 - part of this module's API
    WORKERS,
    FnCollector,
    track_worker,
    untrack_worker,
    worker_collector,
)

prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]  # as vLLM: no *_created series

REGISTRY = CollectorRegistry()
prometheus_client.ProcessCollector(registry=REGISTRY)  # process_cpu_seconds, memory, fds
prometheus_client.PlatformCollector(registry=REGISTRY)  # python_info
prometheus_client.GCCollector(registry=REGISTRY)
P = "perigee:"

# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
# Stages are much shorter than a request: finer at the low end.
STAGE_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)


def buckets_1_2_5(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's build_1_2_5_buckets)."""
    out: list[int] = []
    m = 1
    while True:
        for k in (1, 2, 5):
            if k * m > limit:
                return tuple(out)
            out.append(k * m)
        m *= 10


TOKEN_BUCKETS = buckets_1_2_5(131072)
M = ["model_name"]

# ------------------------------------------------------------------ gateway
TTFT = Histogram(
    P + "time_to_first_token_seconds",
    "Histogram of time to first token in seconds.",
    M,
    buckets=TTFT_BUCKETS,
    registry=None,
)
ITL = Histogram(
    P + "inter_token_latency_seconds",
    "Histogram of inter-token latency in seconds.",
    M,
    buckets=ITL_BUCKETS,
    registry=None,
)
TPOT = Histogram(
    P + "request_time_per_output_token_seconds",
    "Histogram of time_per_output_token_seconds per request.",
    M,
    buckets=ITL_BUCKETS,
    registry=None,
)
E2E = Histogram(
    P + "e2e_request_latency_seconds",
    "Histogram of e2e request latency in seconds.",
    M,
    buckets=REQUEST_LATENCY_BUCKETS,
    registry=None,
)
REQUEST_PROMPT_TOKENS = Histogram(
    P + "request_prompt_tokens",
    "Number of prefill tokens processed.",
    M,
    buckets=TOKEN_BUCKETS,
    registry=None,
)
REQUEST_GENERATION_TOKENS = Histogram(
    P + "request_generation_tokens",
    "Number of generation tokens processed.",
    M,
    buckets=TOKEN_BUCKETS,
    registry=None,
)
REQUEST_MAX_TOKENS = Histogram(
    P + "request_params_max_tokens",
    "Histogram of the max_tokens request parameter.",
    M,
    buckets=TOKEN_BUCKETS,
    registry=None,
)
PROMPT_TOKENS = Counter(
    P + "prompt_tokens", "Number of prefill tokens processed.", M, registry=None
)
GENERATION_TOKENS = Counter(
    P + "generation_tokens", "Number of generation tokens processed.", M, registry=None
)
REQUEST_SUCCESS = Counter(
    P + "request_success",
    "Count of successfully processed requests.",
    [*M, "finished_reason"],
    registry=None,
)
REQUEST_ERRORS = Counter(
    P + "request_errors",
    "Requests answered with an HTTP error, by status.",
    [*M, "status"],
    registry=None,
)
IN_FLIGHT = Gauge(
    P + "gateway_requests_in_flight", "Requests the gateway is serving now.", registry=None
)
MAX_INFLIGHT = Gauge(
    P + "gateway_max_requests_in_flight",
    "The gateway's cap on requests served at once (--max-inflight).",
    registry=None,
)
INFLIGHT_REJECTIONS = Counter(
    P + "gateway_requests_over_inflight_cap",
    "Requests the gateway answered 429 because it was at its cap.",
    registry=None,
)

LATENESS_REJECTIONS = Counter(
    P + "gateway_requests_over_lateness",
    "Requests the gateway answered 429 because the stack was behind: four requests "
    "unplaced for longer than --max-overhead-ms while others were placed, as many "
    "waiting for their first token as first tokens with more overhead let, or (with "
    "--max-lateness-ms) a first token overdue by more than that.",
    registry=None,
)
CONTROL_OVERHEAD = Histogram(
    P + "gateway_control_plane_overhead_seconds",
    "A first token's wait since the gateway sent its request, less the part the prefill "
    "engine accounts for (its queue, the prefix's load, the compute): what "
    "--max-overhead-ms judges.",
    buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0),
    registry=None,
)
WAIT_CAP = Gauge(
    P + "gateway_first_token_wait_cap",
    "How many requests may wait on the control plane for their first token before the "
    "gateway answers 429 (the AIMD cap that late first tokens cut; 4096: not capping).",
    registry=None,
)

# ------------------------------------------------------------------ state and failures
STATE_ENTRIES = Gauge(
    P + "state_entries",
    "Entries in a map or queue this service keeps per request, instance or peer (each "
    "bounded: pruned or capped), by map.",
    ["map"],
    registry=None,
)
INTAKE_BYPASSES = Counter(
    P + "intake_bypasses",
    "Requests sent on the core NATS path because a JetStream work queue did not store "
    "them within --intake-patience (a stream electing a leader), by hop.",
    ["hop"],
    registry=None,
)
INSTANCE_RESTARTS = Counter(
    P + "instance_restarts_seen",
    "New incarnations of a known instance name (a restarted process) the gateway saw.",
    registry=None,
)
REQUESTS_WEDGED = Counter(
    P + "requests_wedged",
    "Requests the gateway moved off an instance that reported load but made no "
    "progress on them far beyond its predicted time.",
    registry=None,
)
CANCELS_UNACKED = Counter(
    P + "cancels_unacknowledged",
    "Cancels that ended without every holder's acknowledgement (its incarnation ended "
    "or the request timeout passed).",
    registry=None,
)

# ------------------------------------------------------------------ admission / conductor
REJECTIONS = Counter(
    P + "requests_rejected",
    "Requests refused before prefill, by service, status code and reason.",
    ["service", "code", "reason"],
    registry=None,
)
ADMITTED = Counter(
    P + "requests_admitted", "Requests admission forwarded to the conductor.", registry=None
)
INTAKE_RESENT = Counter(
    P + "intake_placements_resent",
    "Placements a conductor sent again "
    "from their claim (a redelivered request, already placed once).",
    registry=None,
)
MIGRATIONS = Counter(
    P + "migrations",
    "Requests resent after their prefill or decode instance "
    "died, as the conductor placed them, by reason.",
    ["reason"],
    registry=None,
)
MIGRATION_KV_TOKENS = Counter(
    P + "migration_kv_tokens",
    "Context tokens of migrated requests a decode instance took over: "
    "kind=pulled (KV loaded from a store, not computed) or recomputed (prefill computed them "
    "again: the generated tokens and the prompt's partial last block).",
    ["kind"],
    registry=None,
)


def _stage(name: str, doc: str, labels: Iterable[str] = ()) -> Histogram:
    return Histogram(P + name, doc, list(labels), buckets=STAGE_BUCKETS, registry=None)


SCHEDULING_TIME = _stage(
    "request_scheduling_time_seconds",
    "Conductor placement plus store transactions (span conductor.place).",
)
QUEUE_TIME = _stage(
    "request_queue_time_seconds", "Time spent waiting in the prefill queue (span prefill.queue)."
)
PREFIX_LOAD_TIME = _stage(
    "request_prefix_load_time_seconds",
    "Remote prefix pulled into the prefill node (span prefill.load_prefix).",
)
PREFILL_TIME = _stage(
    "request_prefill_time_seconds", "Layer-wise prefill compute (span prefill.compute)."
)
KV_TRANSFER_TIME = _stage(
    "kv_transfer_time_seconds",
    "KV shipped from the prefill to the decode node, overlapping the compute (span prefill.ship).",
)
DECODE_LOAD_TIME = _stage(
    "request_decode_load_time_seconds",
    "Decode engine loading the request's KV from its node's store (span decode.load_kv).",
)
DECODE_TIME = _stage(
    "request_decode_time_seconds",
    "Time spent generating after the first token (span decode.generate).",
)
STORE_TRANSFER_TIME = _stage(
    "store_transfer_time_seconds", "Data-plane operations of a store (spans store.*).", ["op"]
)

# Online calibration (services.common.calibrator): the instance's fit at the start of a
# prefill's compute over the compute's measured time; 1.0 is a perfect prediction.
RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 0.95, 1.05, 1.11, 1.25, 1.5, 2.0, 4.0)
PREFILL_PREDICTED_OVER_MEASURED = Histogram(
    P + "prefill_time_predicted_over_measured",
    "Prefill compute time predicted by the instance's own online fit over the measured time.",
    buckets=RATIO_BUCKETS,
    registry=None,
)

# span name -> (histogram, labels)
SPAN_HISTOGRAMS: dict[str, tuple[Histogram, dict[str, str]]] = {
    "conductor.place": (SCHEDULING_TIME, {}),
    "prefill.queue": (QUEUE_TIME, {}),
    "prefill.load_prefix": (PREFIX_LOAD_TIME, {}),
    "prefill.compute": (PREFILL_TIME, {}),
    "prefill.ship": (KV_TRANSFER_TIME, {}),
    "decode.load_kv": (DECODE_LOAD_TIME, {}),
    "decode.generate": (DECODE_TIME, {}),
    "store.ship": (STORE_TRANSFER_TIME, {"op": "ship"}),
    "store.pull": (STORE_TRANSFER_TIME, {"op": "pull"}),
    "store.write": (STORE_TRANSFER_TIME, {"op": "write"}),
    "store.read": (STORE_TRANSFER_TIME, {"op": "read"}),
    "store.close": (STORE_TRANSFER_TIME, {"op": "close"}),
    "store.lease": (STORE_TRANSFER_TIME, {"op": "lease"}),
}

GROUPS: dict[str, list[Any]] = {
    "gateway": [
        TTFT,
        ITL,
        TPOT,
        E2E,
        REQUEST_PROMPT_TOKENS,
        REQUEST_GENERATION_TOKENS,
        REQUEST_MAX_TOKENS,
        PROMPT_TOKENS,
        GENERATION_TOKENS,
        REQUEST_SUCCESS,
        REQUEST_ERRORS,
        IN_FLIGHT,
        MAX_INFLIGHT,
        INFLIGHT_REJECTIONS,
        LATENESS_REJECTIONS,
        CONTROL_OVERHEAD,
        WAIT_CAP,
        STATE_ENTRIES,
        INTAKE_BYPASSES,
        INSTANCE_RESTARTS,
        REQUESTS_WEDGED,
        CANCELS_UNACKED,
    ],
    "admission": [REJECTIONS, ADMITTED, STATE_ENTRIES, INTAKE_BYPASSES],
    "conductor": [
        REJECTIONS,
        SCHEDULING_TIME,
        MIGRATIONS,
        INTAKE_RESENT,
        STATE_ENTRIES,
        INTAKE_BYPASSES,
    ],
    Role.PREFILL: [
        QUEUE_TIME,
        PREFIX_LOAD_TIME,
        PREFILL_TIME,
        KV_TRANSFER_TIME,
        PREFILL_PREDICTED_OVER_MEASURED,
    ],
    Role.DECODE: [DECODE_LOAD_TIME, DECODE_TIME, MIGRATION_KV_TOKENS],
    "store": [STORE_TRANSFER_TIME],
}


class SpanMetrics(SpanProcessor):
    """Observes the stage histograms when their spans end (errors are not observed)."""

    def __init__(
        self, histograms: dict[str, tuple[Histogram, dict[str, str]]] | None = None
    ) -> None:
        self.histograms = SPAN_HISTOGRAMS if histograms is None else histograms

    def on_end(self, span: ReadableSpan) -> None:
        entry = self.histograms.get(span.name)
        if entry is None or span.end_time is None or span.start_time is None:
            return
        if span.status.status_code == StatusCode.ERROR:
            return
        hist, labels = entry
        seconds = max(0, span.end_time - span.start_time) / 1e9
        (hist.labels(**labels) if labels else hist).observe(seconds)


# ------------------------------------------------------------------ rejection reasons

_REASONS = (
    ("no live prefill", "no_prefill_instance"),
    ("no live decode", "no_decode_instance"),
    ("prefill pool overloaded", "prefill_overloaded"),
    ("decode pool overloaded", "decode_overloaded"),
    ("tbt slo after prefill", "tbt_slo_after_prefill"),
    ("predicted ttft", "ttft_slo"),
    ("predicted tbt", "tbt_slo"),
    ("no store could take", "store"),
    ("empty prompt", "empty_prompt"),
    ("placement failed", "internal"),
)


def reason_label(message: str) -> str:
    """A low-cardinality label for a rejection message: known phrases map to a slug,
    others to their first words with numbers dropped."""
    low = message.lower()
    for phrase, slug in _REASONS:
        if phrase in low:
            return slug
    words = re.sub(r"[^a-z ]+", " ", low).split()[:4]
    return "_".join(words) or "unknown"


def count_rejection(service: str, code: int, message: str) -> None:
    REJECTIONS.labels(service=service, code=str(int(code)), reason=reason_label(message)).inc()


# ------------------------------------------------------------------ collectors
# (read a service's state at scrape time: services.common.metric_collectors)

# ------------------------------------------------------------------ set-up and serving

_registered: set[int] = set()


def register(*collectors: Any, registry: CollectorRegistry = REGISTRY) -> None:
    """Add metrics or collectors to the registry once (idempotent per object)."""
    for c in collectors:
        if id(c) in _registered and registry is REGISTRY:
            continue
        registry.register(c)
        if registry is REGISTRY:
            _registered.add(id(c))


def setup(service: str, *collectors: Any, span_metrics: bool = True) -> None:
    """Register ``service``'s metric group and ``collectors``; with ``span_metrics``,
    stage histograms follow this process's spans (call after ``setup_tracing``)."""
    register(*GROUPS.get(service, ()), *collectors)
    global _span_metrics
    if span_metrics and _span_metrics is None:
        from tracing import add_span_processor

        proc = SpanMetrics()
        if add_span_processor(proc):
            _span_metrics = proc


_span_metrics: SpanMetrics | None = None


def sample(metric: Any, name: str | None = None, **labels: str) -> float:
    """The current value of one sample of ``metric`` (0 if it has none yet): for tests
    and for code that reads back what it counted. ``name`` defaults to the metric's
    own (``_total`` for counters, e.g. ``..._count`` for a histogram's count)."""
    for family in metric.collect():
        want = name or (family.name + "_total" if family.type == "counter" else family.name)
        for s in family.samples:
            if s.name == want and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0


def exposition(registry: CollectorRegistry = REGISTRY) -> bytes:
    return generate_latest(registry)


async def metrics_handler(request: web.Request) -> web.Response:
    resp = web.Response(body=exposition())
    resp.content_type = CONTENT_TYPE_LATEST.split(";")[0]
    resp.charset = "utf-8"
    return resp


class MetricsServer:
    """``GET /metrics`` on its own port, on the running event loop, beside the probes
    an orchestrator asks for: ``/health`` (200 while the event loop answers) and
    ``/ready`` (200 while ``ready()`` says the service serves, else 503; the service
    sets it, e.g. a worker once its engine is calibrated and it takes tasks)."""

    def __init__(self, host: str, port: int, ready: Callable[[], bool] | None = None) -> None:
        self.host, self.port = host, port
        self.ready: Callable[[], bool] = ready or (lambda: True)
        self._runner: web.AppRunner | None = None

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _ready(self, _request: web.Request) -> web.Response:
        if self.ready():
            return web.Response(text="ready\n")
        return web.Response(status=503, text="not ready\n")

    async def start(self) -> "MetricsServer":
        app = web.Application()
        app.add_routes(
            [
                web.get("/metrics", metrics_handler),
                web.get("/health", self._health),
                web.get("/ready", self._ready),
            ]
        )
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        self.port = self._runner.addresses[0][1]
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


async def serve_metrics(
    host: str, port: int, ready: Callable[[], bool] | None = None
) -> MetricsServer:
    """Serve :data:`REGISTRY` on ``http://host:port/metrics`` (port 0: any free port),
    and ``/health`` and ``/ready`` (:class:`MetricsServer`)."""
    return await MetricsServer(host, port, ready).start()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve Prometheus /metrics on this port (0: off)",
    )
    p.add_argument("--metrics-host", default="127.0.0.1", help="address /metrics binds")


async def start_from_args(
    args: argparse.Namespace,
    services: str | Iterable[str],
    *collectors: Collector,
    ready: Callable[[], bool] | None = None,
) -> MetricsServer | None:
    """:func:`setup` (of one service or several, e.g. a switchable worker's two roles)
    plus :func:`serve_metrics`, when ``--metrics-port`` is set."""
    if not getattr(args, "metrics_port", 0):
        return None
    names = [services] if isinstance(services, str) else list(services)
    for i, name in enumerate(names):
        setup(name, *(collectors if i == 0 else ()))
    return await serve_metrics(args.metrics_host, args.metrics_port, ready)
