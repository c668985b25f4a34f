"""Collectors that read a service's state when Prometheus scrapes (on the service's
event loop, see :func:`services.common.metrics.serve_metrics`): queue depth and
counters of prefill/decode workers, bytes per tier and transfers of a store, the
conductor's placement counters. Names are documented in :mod:`services.common.metrics`.
"""

import re
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from bus_schemas.roles import Role

P = "perigee:"


def _counter(name: str, doc: str, value: float, labels: dict[str, str] | None = None) -> Metric:
    m = CounterMetricFamily(P + name, doc, labels=list(labels or {}))
    m.add_metric(list((labels or {}).values()), value)
    return m


def _gauge(name: str, doc: str, value: float) -> Metric:
    return GaugeMetricFamily(P + name, doc, value=value)


def _labelled(family: Any, name: str, doc: str, label: str, values: dict[str, float]) -> Metric:
    m = family(P + name, doc, labels=[label])
    for k, v in values.items():
        m.add_metric([k], v)
    return m  # type: ignore[no-any-return]  # family is one of prometheus_client's *MetricFamily


def _counters(prefix: str, counters: dict[str, int], skip: Iterable[str] = ()) -> list[Metric]:
    skip = set(skip)
    return [
        _counter(f"{prefix}_{k}", f"{prefix} counter {k}.", v)
        for k, v in sorted(counters.items())
        if k not in skip
    ]


class FnCollector(Collector):
    """Adapts a function returning metric families (read at scrape time)."""

    def __init__(self, fn: Callable[[], Iterable[Metric]]) -> None:
        self.fn = fn

    def collect(self) -> Iterable[Metric]:
        return list(self.fn())


# Workers register themselves while they serve (a switchable instance changes role).
WORKERS: dict[str, Any] = {}


def track_worker(role: str, worker: Any) -> None:
    WORKERS[role] = worker


def untrack_worker(role: str, worker: Any) -> None:
    if WORKERS.get(role) is worker:
        del WORKERS[role]


def _prefill(worker: Any) -> tuple[int, int, list[Metric]]:
    q = worker.queue
    _, queued_tokens, work_s = q.load()
    c = dict(worker.counters)
    hits = c.get("prefix_tokens_loaded", 0)
    return (
        int(q.running is not None),
        len(q.waiting),
        [
            _gauge("prefill_queued_tokens", "Prompt tokens queued or running.", queued_tokens),
            _gauge("prefill_queued_work_seconds", "Predicted compute of the queue.", work_s),
            _counter(
                "prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                c.get("computed_tokens", 0) + hits,
            ),
            _counter(
                "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", hits
            ),
            _counter(
                "prefix_cache_remote_hits",
                "Prefix tokens pulled from another node's store.",
                c.get("remote_tokens_pulled", 0),
            ),
            *_counters(Role.PREFILL, c),
        ],
    )


def _decode(worker: Any) -> tuple[int, int, list[Metric]]:
    st = worker.engine.stats()
    return (
        st.batch_size,
        st.waiting + getattr(worker, "_loading", 0),
        [
            _gauge("decode_kv_tokens", "Context tokens held by the running batch.", st.kv_tokens),
            _gauge(
                "decode_step_time_seconds", "Estimated time of one decode step.", st.step_time_s
            ),
            *_counters(Role.DECODE, dict(worker.counters)),
        ],
    )


def worker_collector(workers: dict[str, Any] | None = None) -> Collector:
    """Queue depth (``num_requests_running``/``waiting``: prefill queue, decode batch and
    waiting + loading) and counters of the prefill/decode workers in ``workers``
    (default: those tracked in :data:`WORKERS`)."""

    def collect() -> list[Metric]:
        ws = WORKERS if workers is None else workers
        running = waiting = 0
        out: list[Metric] = []
        for role, fn in ((Role.PREFILL, _prefill), (Role.DECODE, _decode)):
            w = ws.get(role)
            if w is not None:
                r, q, ms = fn(w)
                running, waiting = running + r, waiting + q
                out += ms
        return [
            _gauge(
                "num_requests_running",
                "Requests in prefill or in the running decode batch.",
                running,
            ),
            _gauge(
                "num_requests_waiting",
                "Requests queued for prefill, or waiting for a decode "
                "batch slot or loading their KV.",
                waiting,
            ),
            *out,
        ]

    return FnCollector(collect)


_BLOCK_STATES = {
    "free_blocks": "free",
    "cached_blocks": "cached",
    "evictable_blocks": "evictable",
    "locked_blocks": "locked",
    "pinned_blocks": "pinned",
    "tx_owned_blocks": "tx_owned",
}
_DATA = {
    "bytes_in",
    "bytes_out",
    "transfer_errors",
    "bad_frames",
    "ships",
    "pulls",
    "writes_in",
    "reads_in",
    "local_copies",
    "blocks_written_remote",
    "blocks_read_remote",
    "tcp_bytes",
    "shm_bytes",
    "rdma_bytes",
}
_TIER_CAPACITY = re.compile(r"([a-z]+)_capacity_blocks")


def store_tiers(pool_stats: dict[str, int], block_bytes: int) -> dict[str, tuple[int, int]]:
    """``{tier: (used_bytes, capacity_bytes)}``: DRAM (the arena) from ``used_blocks`` /
    ``capacity_blocks``, lower tiers from ``<tier>_blocks`` / ``<tier>_capacity_blocks``."""
    out = {
        "dram": (
            pool_stats.get("used_blocks", 0) * block_bytes,
            pool_stats.get("capacity_blocks", 0) * block_bytes,
        )
    }
    for k, cap in pool_stats.items():
        m = _TIER_CAPACITY.fullmatch(k)
        if m and m.group(1) != "dram":
            out[m.group(1)] = (
                pool_stats.get(f"{m.group(1)}_blocks", 0) * block_bytes,
                cap * block_bytes,
            )
    return out


def store_collector(service: Any) -> Collector:
    """Bytes per tier, block states, transfer bytes and errors of a :class:`StoreService`.

    Tiers come from the pool's stats (:func:`store_tiers`), or from
    ``service.tier_stats()`` -> ``{tier: (used_bytes, capacity_bytes)}`` when it has one.
    The pool's ``counters`` are exported as counters, its other stats as gauges."""

    def collect() -> list[Metric]:
        pool = dict(service.pool.stats())
        counter_keys = set(getattr(service.pool, "counters", {}))
        data = dict(service.data.counters) if getattr(service, "data", None) else {}
        if hasattr(service, "tier_stats"):
            tiers = dict(service.tier_stats())
        else:
            tiers = store_tiers(pool, service.block_bytes)
        dram_used, dram_cap = tiers.get("dram", (0, 0))
        gauges = {k: v for k, v in pool.items() if k not in counter_keys and k not in _BLOCK_STATES}
        return [
            _labelled(
                GaugeMetricFamily,
                "store_bytes",
                "KV bytes held, per tier.",
                "tier",
                {t: u for t, (u, _) in tiers.items()},
            ),
            _labelled(
                GaugeMetricFamily,
                "store_capacity_bytes",
                "KV capacity, per tier.",
                "tier",
                {t: c for t, (_, c) in tiers.items()},
            ),
            _gauge(
                "kv_cache_usage_perc",
                "KV-cache usage of the DRAM tier. 1 means 100 percent.",
                dram_used / dram_cap if dram_cap else 0.0,
            ),
            _labelled(
                GaugeMetricFamily,
                "store_blocks",
                "DRAM blocks by state.",
                "state",
                {s: pool.get(k, 0) for k, s in _BLOCK_STATES.items()},
            ),
            *[_gauge(f"store_{k}", f"store gauge {k}.", v) for k, v in sorted(gauges.items())],
            _labelled(
                CounterMetricFamily,
                "transfer_bytes",
                "KV bytes moved store to store.",
                "direction",
                {"in": data.get("bytes_in", 0), "out": data.get("bytes_out", 0)},
            ),
            _labelled(
                CounterMetricFamily,
                "kv_transfer_bytes",
                "KV bytes this store moved through the transfer engine (ships sent, "
                "pulls received), per transport.",
                "transport",
                {t: data.get(f"{t}_bytes", 0) for t in ("shm", "tcp", "rdma")},
            ),
            _labelled(
                CounterMetricFamily,
                "transfer_errors",
                "Failed data-plane requests.",
                "kind",
                {
                    "transfer": data.get("transfer_errors", 0),
                    "bad_frame": data.get("bad_frames", 0),
                },
            ),
            _labelled(
                CounterMetricFamily,
                "transfer_requests",
                "Data-plane requests served.",
                "op",
                {
                    "ship": data.get("ships", 0),
                    "pull": data.get("pulls", 0),
                    "write": data.get("writes_in", 0),
                    "read": data.get("reads_in", 0),
                    "local_copy": data.get("local_copies", 0),
                },
            ),
            _labelled(
                CounterMetricFamily,
                "transfer_blocks",
                "Blocks moved store to store.",
                "direction",
                {
                    "in": data.get("blocks_written_remote", 0),
                    "out": data.get("blocks_read_remote", 0),
                },
            ),
            *_counters("store", {k: v for k, v in pool.items() if k in counter_keys}),
            *_counters("store_data", data, skip=_DATA),
        ]

    return FnCollector(collect)


def conductor_collector(service: Any) -> Collector:
    """Placement counters of the conductor's policy and its pending requests."""

    def collect() -> list[Metric]:
        return [
            _gauge(
                "conductor_pending_requests",
                "Requests placed and not yet committed.",
                len(service.pending),
            ),
            *_counters("conductor", dict(getattr(service.policy, "stats", {}))),
        ]

    return FnCollector(collect)
