"""What the collectors that read a service's state at scrape time share (on the
service's event loop, see :func:`services.common.metrics.serve_metrics`): metric
builders, :class:`FnCollector`, and the worker collector, which sums the samples of the
prefill and decode workers a process serves. Each service's own collector lives in
that service (``services/{prefill,decode,store,conductor}/metrics.py``), typed against
its objects. Names are documented in :mod:`services.common.metrics`.
"""

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from bus_schemas.roles import Role

P = "perigee:"


def counter(name: str, doc: str, value: float, labels: dict[str, str] | None = None) -> Metric:
    m = CounterMetricFamily(P + name, doc, labels=list(labels or {}))
    m.add_metric(list((labels or {}).values()), value)
    return m


def gauge(name: str, doc: str, value: float) -> Metric:
    return GaugeMetricFamily(P + name, doc, value=value)


def labelled(family: Any, name: str, doc: str, label: str, values: dict[str, float]) -> Metric:
    m = family(P + name, doc, labels=[label])
    for k, v in values.items():
        m.add_metric([k], v)
    return m  # type: ignore[no-any-return]  # family is one of prometheus_client's *MetricFamily


def counters(prefix: str, values: dict[str, int], skip: Iterable[str] = ()) -> list[Metric]:
    """One counter per ``values`` entry, named ``<prefix>_<key>``."""
    skip = set(skip)
    return [
        counter(f"{prefix}_{k}", f"{prefix} counter {k}.", v)
        for k, v in sorted(values.items())
        if k not in skip
    ]


class FnCollector(Collector):
    """Adapts a function returning metric families (read at scrape time)."""

    def __init__(self, fn: Callable[[], Iterable[Metric]]) -> None:
        self.fn = fn

    def collect(self) -> Iterable[Metric]:
        return list(self.fn())


class WorkerSample(NamedTuple):
    """One worker's queue depth and metrics at a scrape."""

    running: int
    waiting: int
    metrics: list[Metric]


Sampler = Callable[[], WorkerSample]

# Workers register themselves while they serve (a switchable instance changes role):
# role -> (the worker, how to sample it).
WORKERS: dict[str, tuple[object, Sampler]] = {}


def track_worker(role: str, worker: object, sample: Sampler) -> None:
    WORKERS[role] = (worker, sample)


def untrack_worker(role: str, worker: object) -> None:
    if role in WORKERS and WORKERS[role][0] is worker:
        del WORKERS[role]


def worker_collector(samplers: dict[str, Sampler] | None = None) -> Collector:
    """Queue depth (``num_requests_running``/``waiting``: prefill queue, decode batch and
    waiting + loading) and metrics of the prefill/decode workers, summed over roles:
    ``samplers`` by role (default: the workers tracked in :data:`WORKERS`)."""

    def collect() -> list[Metric]:
        ss = {r: s for r, (_, s) in WORKERS.items()} if samplers is None else samplers
        running = waiting = 0
        out: list[Metric] = []
        for role in (Role.PREFILL, Role.DECODE):
            sample = ss.get(role)
            if sample is not None:
                r, q, ms = sample()
                running, waiting = running + r, waiting + q
                out += ms
        return [
            gauge(
                "num_requests_running",
                "Requests in prefill or in the running decode batch.",
                running,
            ),
            gauge(
                "num_requests_waiting",
                "Requests queued for prefill, or waiting for a decode "
                "batch slot or loading their KV.",
                waiting,
            ),
            *out,
        ]

    return FnCollector(collect)
