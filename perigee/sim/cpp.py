"""A pipelined prefill (chunked pipeline parallelism, paper §3.3) across simulated
prefill instances, timed by :func:`services.conductor.cpp.pipeline_timing`.

The conductor placed the request on a group (``Placement.cpp_stages``). Each member
gets one :class:`StageTask` in its FIFO. A member that reaches its task is ready; once
it and every stage before it are, its stage is scheduled chunk by chunk::

    chunk k on stage s: max(chunk k done on stage s-1 + hand-off, chunk k-1 done on
                            stage s, member s ready) + chunk_time(k) / X

Stages other than the anchor (the member holding the prefix) are ready no earlier than
the prefix slices they read from the anchor's store (over the anchor's link, from the placement on). When stage s is done,
member s ships its 1/X of the layers' KV to the decode node (overlapped with its stage,
as a single instance does) and is free again; the last stage's end is the first token,
and the KV has landed once every stage's ship has. A member that is ready before its
input arrives idles, as a real stage would.
"""

from collections.abc import Callable, Sequence
from typing import Protocol

from bus_schemas.load import PrefillLoad
from perigee.sim.cluster import Link
from perigee.sim.events import EventLoop
from perigee.sim.request import SimRequest
from services.common.cost_model import CostModel
from services.conductor import cpp


class StageMember(Protocol):
    """What a pipeline needs of a member (perigee.sim.instances.PrefillInstance, which
    imports this module: named by its shape to keep the two out of an import cycle)."""

    link: Link
    running_end: float

    def load(self, now: float) -> PrefillLoad: ...

    def push_stage(self, task: "StageTask") -> None: ...

    def stage_done(self, task: "StageTask") -> None: ...


class StageTask:
    """Member ``stage``'s share of a pipelined request, as it sits in the member's queue."""

    __slots__ = ("gang", "stage", "est_work_s", "tokens")

    def __init__(self, gang: "Gang", stage: int, est_work_s: float, tokens: int) -> None:
        self.gang, self.stage, self.est_work_s, self.tokens = gang, stage, est_work_s, tokens

    # What services.prefill.queue.PrefillQueue reads of it (QueueItem): priced at the
    # member's share the conductor booked, its prefix slices read inside that share.
    @property
    def request_id(self) -> str:
        return self.gang.req.rid

    @property
    def prompt_tokens(self) -> int:
        return self.gang.req.num_tokens

    @property
    def prefix_tokens(self) -> int:
        return self.gang.prefix

    @property
    def pulled_tokens(self) -> int:
        return 0

    @property
    def stage_work_s(self) -> float | None:
        return self.est_work_s


class Gang:
    def __init__(
        self,
        req: SimRequest,
        members: Sequence[StageMember],
        loop: EventLoop,
        cost: CostModel,
        chunk_tokens: int,
        anchor_link: Link,
        on_prefilled: Callable[[SimRequest, float], None],
    ) -> None:
        self.req, self.members, self.loop, self.cost = req, list(members), loop, cost
        self.chunk_tokens, self.on_prefilled = chunk_tokens, on_prefilled
        n, x = req.num_tokens, len(members)
        self.prefix = min(req.cached_tokens, n - 1)
        now = loop.now()
        slices = cpp.slice_tokens(self.prefix, x)
        self.slices_at = anchor_link.transfer(slices, now) if slices else now
        self.anchor = next(i for i, m in enumerate(self.members) if m.link is anchor_link)
        # The estimate the members report until they run it (as the conductor booked it).
        queues = [m.load(now).queued_work_s for m in self.members]
        est = cpp.pipeline_timing(
            [cost] * x,
            n,
            self.prefix,
            chunk_tokens,
            ready=cpp.ready_times(queues, self.slices_at - now, self.anchor),
        )
        req.compute_s = sum(est.stage_compute_s)
        self.tasks = [
            StageTask(self, s, w, n - self.prefix)
            for s, w in enumerate(cpp.member_work(queues, est))
        ]
        self.ready: list[float | None] = [None] * x
        self.scheduled = 0  # stages 0..scheduled-1 have their timing
        self.timing: cpp.PipelineTiming | None = None
        self.left = x
        self.arrive_at = 0.0  # when the last stage's KV has landed on the decode node

    def push(self) -> None:
        self.req.state = "QUEUED"
        for inst, task in zip(self.members, self.tasks, strict=True):
            inst.push_stage(task)

    def arrive(self, task: StageTask) -> None:
        """Member ``task.stage`` has reached its task at the head of its queue."""
        now = self.loop.now()
        s = task.stage
        self.ready[s] = now if s == self.anchor else max(now, self.slices_at)
        if s == 0:
            self.req.state, self.req.started = "PREFILLING", now
        x = len(self.members)
        while self.scheduled < x and self.ready[self.scheduled] is not None:
            k = self.scheduled + 1
            ready = [r for r in self.ready[:k] if r is not None]
            self.timing = cpp.pipeline_timing(
                [self.cost] * k,
                self.req.num_tokens,
                self.prefix,
                self.chunk_tokens,
                ready=ready,
                parts=x,
            )
            member, end = self.members[self.scheduled], self.timing.stage_end_s[self.scheduled]
            member.running_end = end
            self.loop.at(end, member.stage_done, self.tasks[self.scheduled])
            self.scheduled = k

    def stage_compute_s(self, stage: int) -> float:
        assert self.timing is not None
        return self.timing.stage_compute_s[stage]

    def stage_done(self, inst: StageMember, task: StageTask) -> None:
        assert self.timing is not None
        now, x = self.loop.now(), len(self.members)
        start = self.timing.stage_start_s[task.stage]
        landed = inst.link.ship_overlapped(
            self.req.ship_tokens / x, start, now, max(1, self.cost.layers // x)
        )
        self.arrive_at = max(self.arrive_at, landed)
        self.left -= 1
        if self.left == 0:
            self.req.prefill_end = now
            self.req.state = "SHIPPING"
            self.on_prefilled(self.req, self.arrive_at)


# Prompt-length buckets of ``perigee sim repro cpp`` (tokens, [min, max)).
BUCKETS = ((0, 8192), (8192, 16384), (16384, 32768), (32768, 65536), (65536, None))
TTFT_THRESHOLD_S = 10.0  # the Fig. 23 threshold: beyond ~78k tokens one node cannot meet it


def ttft_buckets(
    runs: dict[int, Sequence[SimRequest]], ttft_max: float = TTFT_THRESHOLD_S
) -> list[dict]:
    """Per prompt-length bucket and group size X (``runs``: X -> the run's requests):
    mean and p90 TTFT of the completed requests, and the share of *all* the bucket's
    requests completed within ``ttft_max``."""
    from perigee.bench.stats import percentile

    out = []
    for lo, hi in BUCKETS:
        row: dict = {
            "min_tokens": lo,
            "max_tokens": hi,
            "requests": 0,
            "ttft_s": {},
            "ttft_p90_s": {},
            "within_ttft": {},
            "rejected": {},
        }
        for x, reqs in runs.items():
            rs = [r for r in reqs if r.num_tokens >= lo and (hi is None or r.num_tokens < hi)]
            done = [r.ttft_s for r in rs if r.state == "DONE"]
            row["requests"] = len(rs)
            row["ttft_s"][str(x)] = sum(done) / len(done) if done else None
            row["ttft_p90_s"][str(x)] = percentile(done, 90) if done else None
            row["within_ttft"][str(x)] = (
                sum(1 for t in done if t <= ttft_max) / len(rs) if rs else None
            )
            row["rejected"][str(x)] = sum(1 for r in rs if r.state == "REJECTED")
        out.append(row)
    return out
