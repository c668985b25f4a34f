"""perigee.load.<role>.<instance>: periodic load reports that admission and the
conductor read. ``node`` ties an instance to the store it shares a host with.

Fields are append-only with defaults, so a report from an older sender still decodes.
Since calibration (services.common.calibration) a report also carries what the
instance measured since its last report and its own fit of its costs; consumers put
the fit in their CalibrationBook."""

from bus_schemas._base import Msg


class CostFit(Msg):
    """An instance's online fit of its own costs, in measured seconds::

        prefill(n, p) = prefill[0] + prefill[1]*(n - p) + prefill[2]*(n^2 - p^2)
        decode step   = decode[0] + decode[1]*batch + decode[2]*context_tokens

    None: that part is not fitted on this instance (consumers keep their prior)."""

    prefill: list[float] | None = None
    decode: list[float] | None = None
    prefill_samples: int = 0  # measurements behind the fit (0: the instance's prior)
    decode_samples: int = 0


class PrefillLoad(Msg):
    """A prefill instance's periodic report: its queue, its work to do and what it measured."""

    instance: str
    node: str
    queue_len: int  # requests waiting or running
    queued_tokens: int  # uncached prompt tokens still to compute
    queued_work_s: float  # cost-model seconds of prefill work outstanding
    ts: float
    fit: CostFit | None = None  # the instance's own fit (queued_work_s is in its seconds)
    # (prompt tokens, prefix tokens loaded, seconds of compute) of each prefill since
    # the last report
    measured: list[tuple[int, int, float]] = []
    # The reporting process's incarnation (services.common.incarnation): a restart under
    # the same instance name reports a larger one, and whatever the old one held is dead.
    incarnation: int = 0


class DecodeLoad(Msg):
    """A decode instance's periodic report: its batch, its step time and what it measured."""

    instance: str
    node: str
    batch_size: int  # running requests
    waiting: int  # requests whose KV is arriving or that wait for a batch slot
    max_batch: int
    kv_tokens: int  # tokens of context held by the running batch
    step_time_s: float  # cost-model time of one decode step at the current batch (TBT)
    ts: float
    fit: CostFit | None = None  # the instance's own fit
    # (batch size, context tokens, seconds) of the latest decode steps since the last
    # report (at most services.common.calibrator.MAX_REPORTED_STEPS)
    measured: list[tuple[int, int, float]] = []
    incarnation: int = 0  # as PrefillLoad's


class WorkerStats(Msg):
    """Reply on ``subjects.worker_stats(role, instance)``: monotonically growing counters
    (tasks_done, tasks_failed, computed_tokens, prefix_tokens_loaded, ...)."""

    instance: str
    node: str
    role: str
    counters: dict[str, int]
