"""A store's Prometheus metrics, read when Prometheus scrapes: bytes per tier, block
states, transfer bytes, requests and errors (names in :mod:`services.common.metrics`)."""

import re
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.common.metric_collectors import FnCollector, counters, gauge, labelled

if TYPE_CHECKING:
    from services.store.node.server import StoreService

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


def store_collector(service: "StoreService") -> Collector:
    """Bytes per tier, block states, transfer bytes and errors of a :class:`StoreService`.

    Tiers come from the pool's stats (:func:`store_tiers`), or from
    ``service.tier_stats()`` -> ``{tier: (used_bytes, capacity_bytes)}`` when it has one.
    The pool's ``counters`` are exported as counters, its other stats as gauges."""

    def collect() -> list[Metric]:
        pool = dict(service.pool.stats())
        counter_keys = set(getattr(service.pool, "counters", {}))
        data = dict(service.data.counters) if getattr(service, "data", None) else {}
        tier_stats = getattr(service, "tier_stats", None)  # a tiered store's own view
        if tier_stats is not None:
            tiers = dict(tier_stats())
        else:
            tiers = store_tiers(pool, service.block_bytes)
        dram_used, dram_cap = tiers.get("dram", (0, 0))
        gauges = {k: v for k, v in pool.items() if k not in counter_keys and k not in _BLOCK_STATES}
        return [
            labelled(
                GaugeMetricFamily,
                "store_bytes",
                "KV bytes held, per tier.",
                "tier",
                {t: u for t, (u, _) in tiers.items()},
            ),
            labelled(
                GaugeMetricFamily,
                "store_capacity_bytes",
                "KV capacity, per tier.",
                "tier",
                {t: c for t, (_, c) in tiers.items()},
            ),
            gauge(
                "kv_cache_usage_perc",
                "KV-cache usage of the DRAM tier. 1 means 100 percent.",
                dram_used / dram_cap if dram_cap else 0.0,
            ),
            labelled(
                GaugeMetricFamily,
                "store_blocks",
                "DRAM blocks by state.",
                "state",
                {s: pool.get(k, 0) for k, s in _BLOCK_STATES.items()},
            ),
            *[gauge(f"store_{k}", f"store gauge {k}.", v) for k, v in sorted(gauges.items())],
            labelled(
                CounterMetricFamily,
                "transfer_bytes",
                "KV bytes moved store to store.",
                "direction",
                {"in": data.get("bytes_in", 0), "out": data.get("bytes_out", 0)},
            ),
            labelled(
                CounterMetricFamily,
                "kv_transfer_bytes",
                "KV bytes this store moved through the transfer engine (ships sent, "
                "pulls received), per transport.",
                "transport",
                {t: data.get(f"{t}_bytes", 0) for t in ("shm", "tcp", "rdma")},
            ),
            labelled(
                CounterMetricFamily,
                "transfer_errors",
                "Failed data-plane requests.",
                "kind",
                {
                    "transfer": data.get("transfer_errors", 0),
                    "bad_frame": data.get("bad_frames", 0),
                },
            ),
            labelled(
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
            labelled(
                CounterMetricFamily,
                "transfer_blocks",
                "Blocks moved store to store.",
                "direction",
                {
                    "in": data.get("blocks_written_remote", 0),
                    "out": data.get("blocks_read_remote", 0),
                },
            ),
            *counters("store", {k: v for k, v in pool.items() if k in counter_keys}),
            *counters("store_data", data, skip=_DATA),
        ]

    return FnCollector(collect)
