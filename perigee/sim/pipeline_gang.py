"""A pipelined prefill (chunked pipeline parallelism, paper §3.3) across simulated
prefill instances, chunk by chunk.

The conductor placed the request on a group (``Placement.cpp_stages``). Stage s of
chunk k is one :class:`StageTask` in member s's FIFO, queued once the member is done
with chunk k-1 of its stage and chunk k's activations have arrived from stage s-1
(stage 0: at once; the hand-off crosses the link in ``handoff_time``). Stages other
than the anchor (the member holding the prefix) queue their first chunk no earlier
than the prefix slices they read from the anchor's store (over the anchor's link,
from the placement on)::

    chunk k queued on stage s at max(chunk k done on stage s-1 + hand-off,
                                     chunk k-1 done on stage s, slices ready)
    and computed, when the member's FIFO reaches it, in chunk_time(k) / X

A member is therefore held one chunk at a time, never while it waits for input: work
placed on it meanwhile (a short request) runs between two of the pipeline's chunks,
waiting at most for the chunk in progress, and the pipeline's stage stretches by it.
With nothing else queued this is :func:`services.policy.chunk_timing.pipeline_timing`
exactly. When stage s is done, member s ships its 1/X of the layers' KV to the decode
node (overlapped with its stage, as a single instance does); the last stage's end is
the first token, and the KV has landed once every stage's ship has.
"""

from collections.abc import Callable, Sequence
from typing import Protocol

from bus_schemas.load import PrefillLoad
from perigee.sim.cluster import Link
from perigee.sim.events import EventLoop
from perigee.sim.request import SimRequest
from services.common.cost_model import CostModel
from services.policy import chunk_timing


class StageMember(Protocol):
    """What a pipeline needs of a member (perigee.sim.instances.PrefillInstance, which
    imports this module: named by its shape to keep the two out of an import cycle)."""

    link: Link
    running_end: float

    def load(self, now: float) -> PrefillLoad: ...

    def push_stage(self, task: "StageTask") -> None: ...

    def stage_done(self, task: "StageTask") -> None: ...


class StageTask:
    """Chunk ``chunk`` of member ``stage``'s share of a pipelined request (``tokens``
    computed in ``est_work_s``), as it sits in the member's queue."""

    __slots__ = ("gang", "stage", "est_work_s", "tokens", "chunk")

    def __init__(
        self, gang: "Gang", stage: int, est_work_s: float, tokens: int, chunk: int = 0
    ) -> None:
        self.gang, self.stage, self.est_work_s, self.tokens = gang, stage, est_work_s, tokens
        self.chunk = chunk

    # What services.prefill.queue.PrefillQueue reads of it (QueueItem): priced at the
    # chunk's stage time, ``tokens`` of the prompt computed. One id per (stage, chunk):
    # the stage's next chunk is queued while this one is still the running item.
    @property
    def request_id(self) -> str:
        return f"{self.gang.req.rid}/{self.stage}/{self.chunk}"

    @property
    def prompt_tokens(self) -> int:
        return self.gang.req.num_tokens

    @property
    def prefix_tokens(self) -> int:
        return self.gang.req.num_tokens - self.tokens

    @property
    def pulled_tokens(self) -> int:
        return 0

    @property
    def stage_work_s(self) -> float | None:
        return self.est_work_s


class Gang:
    """One request's pipelined prefill across a group of simulated prefill instances."""

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
        self.on_prefilled = on_prefilled
        n, x = req.num_tokens, len(members)
        self.prefix = min(req.cached_tokens, n - 1)
        self.chunks = chunk_timing.chunk_bounds(n, self.prefix, chunk_tokens)
        self.chunk_s = [cost.prefill_time(b, a) / x for a, b in self.chunks]
        self.handoff_s = [chunk_timing.handoff_time(cost, b - a) for a, b in self.chunks]
        req.compute_s = x * sum(self.chunk_s)
        now = loop.now()
        slices = chunk_timing.slice_tokens(self.prefix, x)
        slices_at = anchor_link.transfer(slices, now) if slices else now
        anchor = next(i for i, m in enumerate(self.members) if m.link is anchor_link)
        self.ready_at = [now if s == anchor else slices_at for s in range(x)]
        self.arrived = [len(self.chunks)] + [0] * (x - 1)  # chunks whose input is there
        self.next = [0] * x  # the next chunk each stage queues
        self.busy = [False] * x  # a chunk of the stage is queued or running
        self.started = [-1.0] * x
        self.left = x
        self.arrive_at = 0.0  # when the last stage's KV has landed on the decode node

    def push(self) -> None:
        self.req.state = "QUEUED"
        for s in range(len(self.members)):
            self._queue_next(s)

    def _queue_next(self, s: int) -> None:
        """Queue stage s's next chunk if its input is there and its last one is done."""
        k = self.next[s]
        if self.busy[s] or k >= len(self.chunks) or k >= self.arrived[s]:
            return
        now = self.loop.now()
        if now < self.ready_at[s]:
            self.loop.at(self.ready_at[s], self._queue_next, s)
            return
        self.busy[s] = True
        a, b = self.chunks[k]
        self.members[s].push_stage(StageTask(self, s, self.chunk_s[k], b - a, k))

    def arrive(self, task: StageTask) -> None:
        """Member ``task.stage`` has reached the chunk at the head of its queue: compute."""
        now, s = self.loop.now(), task.stage
        if self.started[s] < 0:
            self.started[s] = now
        if s == 0 and task.chunk == 0:
            self.req.state, self.req.started = "PREFILLING", now
        member = self.members[s]
        member.running_end = now + task.est_work_s
        self.loop.at(member.running_end, member.stage_done, task)

    def stage_compute_s(self, stage: int) -> float:
        """Compute seconds of the chunk stage ``stage`` is finishing (one at a time)."""
        return self.chunk_s[self.next[stage]]

    def stage_done(self, inst: StageMember, task: StageTask) -> None:
        """Member ``inst`` has computed ``task``'s chunk on its stage."""
        now, s, k, x = self.loop.now(), task.stage, task.chunk, len(self.members)
        self.busy[s] = False
        self.next[s] = k + 1
        if s + 1 < x:
            self.loop.after(self.handoff_s[k], self._input, s + 1)
        if k + 1 < len(self.chunks):
            self._queue_next(s)
            return
        landed = inst.link.ship_overlapped(
            self.req.ship_tokens / x, self.started[s], now, max(1, self.cost.layers // x)
        )
        self.arrive_at = max(self.arrive_at, landed)
        self.left -= 1
        if self.left == 0:
            self.req.prefill_end = now
            self.req.state = "SHIPPING"
            self.on_prefilled(self.req, self.arrive_at)

    def _input(self, s: int) -> None:
        self.arrived[s] += 1
        self._queue_next(s)


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
