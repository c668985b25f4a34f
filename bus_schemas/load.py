"""perigee.load.<role>.<instance>: periodic load reports that admission and the
conductor read. ``node`` ties an instance to the store it shares a host with."""

from bus_schemas._base import Msg


class PrefillLoad(Msg):
    instance: str
    node: str
    queue_len: int  # requests waiting or running
    queued_tokens: int  # uncached prompt tokens still to compute
    queued_work_s: float  # cost-model seconds of prefill work outstanding
    ts: float


class DecodeLoad(Msg):
    instance: str
    node: str
    batch_size: int  # running requests
    waiting: int  # requests whose KV is arriving or that wait for a batch slot
    max_batch: int
    kv_tokens: int  # tokens of context held by the running batch
    step_time_s: float  # cost-model time of one decode step at the current batch (TBT)
    ts: float


class WorkerStats(Msg):
    """Reply on ``subjects.worker_stats(role, instance)``: monotonically growing counters
    (tasks_done, tasks_failed, computed_tokens, prefix_tokens_loaded, ...)."""

    instance: str
    node: str
    role: str
    counters: dict[str, int]
