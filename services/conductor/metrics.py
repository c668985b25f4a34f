"""The conductor's Prometheus metrics, read when Prometheus scrapes."""

from typing import TYPE_CHECKING

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from services.common.metric_collectors import FnCollector, counters, gauge

if TYPE_CHECKING:
    from services.conductor.service import ConductorService


def conductor_collector(service: "ConductorService") -> Collector:
    """Placement counters of the conductor's policy and its pending requests."""

    def collect() -> list[Metric]:
        return [
            gauge(
                "conductor_pending_requests",
                "Requests placed and not yet committed.",
                len(service.pending),
            ),
            *counters("conductor", dict(getattr(service.policy, "stats", {}))),
        ]

    return FnCollector(collect)
