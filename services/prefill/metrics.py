"""A prefill worker's queue and prefix-cache metrics, read when Prometheus scrapes
(:func:`services.common.metric_collectors.worker_collector` sums them with decode's)."""

from typing import Any, Protocol

from bus_schemas.roles import Role
from services.common.metric_collectors import WorkerSample, counter, counters, gauge
from services.prefill.queue import PrefillQueue


class ScrapedPrefill(Protocol):
    """What a scrape reads of a :class:`services.prefill.worker.PrefillWorker`."""

    queue: PrefillQueue[Any]
    counters: dict[str, int]


def sample(worker: ScrapedPrefill) -> WorkerSample:
    q = worker.queue
    _, queued_tokens, work_s = q.load()
    c = dict(worker.counters)
    hits = c.get("prefix_tokens_loaded", 0)
    return WorkerSample(
        int(q.running is not None),
        len(q.waiting),
        [
            gauge("prefill_queued_tokens", "Prompt tokens queued or running.", queued_tokens),
            gauge("prefill_queued_work_seconds", "Predicted compute of the queue.", work_s),
            counter(
                "prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                c.get("computed_tokens", 0) + hits,
            ),
            counter(
                "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", hits
            ),
            counter(
                "prefix_cache_remote_hits",
                "Prefix tokens pulled from another node's store.",
                c.get("remote_tokens_pulled", 0),
            ),
            *counters(Role.PREFILL, c),
        ],
    )
