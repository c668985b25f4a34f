"""A decode worker's batch metrics, read when Prometheus scrapes
(:func:`services.common.metric_collectors.worker_collector` sums them with prefill's)."""

from typing import Protocol

from bus_schemas.roles import Role
from services.common.metric_collectors import WorkerSample, counters, gauge
from services.engine.base import Engine


class ScrapedDecode(Protocol):
    """What a scrape reads of a :class:`services.decode.worker.DecodeWorker`."""

    engine: Engine
    counters: dict[str, int]
    _loading: int  # requests whose KV is being loaded


def sample(worker: ScrapedDecode) -> WorkerSample:
    st = worker.engine.stats()
    return WorkerSample(
        st.batch_size,
        st.waiting + worker._loading,
        [
            gauge("decode_kv_tokens", "Context tokens held by the running batch.", st.kv_tokens),
            gauge("decode_step_time_seconds", "Estimated time of one decode step.", st.step_time_s),
            *counters(Role.DECODE, dict(worker.counters)),
        ],
    )
