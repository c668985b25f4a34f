"""Simulated prefill and decode instances, timed by the paper's cost model.

Prefill instance (one GPU node, like ``services/prefill``)::

    waiting (FIFO) --GPU free--> reserving (``reserve``: the store slots, taken when
        compute starts as the live instance does; the instance waits meanwhile)
        --> [pull remote prefix over the holder's link]
        --> computing (chunks of ``chunk_tokens``: chunk [a, b) costs
            cost.prefill_time(b, a)) --> on_prefilled; KV streams to the decode node
            layer by layer, the last layer's share trailing the compute
        --> handing over for ``handoff_s`` (0: none) --> free: on_free, next task

A pipelined request (chunked pipeline parallelism) puts a :class:`StageTask` per chunk
in its group's queues instead (:mod:`perigee.sim.pipeline_gang`): each is queued once its input
is there, and an instance that reaches it computes that chunk of its stage, so work
queued meanwhile runs between two chunks.

``handoff_s`` is the live worker's time between its compute's end and taking the next
task (the last layers' acks, the DecodeTask and FirstTokenNotice publishes); meanwhile
the request still counts in the instance's load (queue_len, no remaining work).

The queue is the live worker's own ``services.prefill.queue.PrefillQueue``: it orders,
prices and reports what waits here (requests and stage tasks alike are its items), so
the load the policies see is computed as the live instance computes it. The instance
adds what only a simulation knows: when the running work ends (the pull's place on its
link, a stage's pipeline timing: ``PrefillQueue.runs_until``).

Decode instance (continuous batching, like the mock engine)::

    waiting --step boundary, batch < max_batch--> running --output_tokens-1 steps--> done

A step of batch B over total context C lasts ``cost.decode_step_time(B, C)``; every
running request gains one token per step, so between two changes of the batch C grows
by B per step and step times form an arithmetic series. The instance therefore
schedules one event per *segment* (steps until the next request finishes), not per
token; a request arriving mid-segment cuts it at the next step boundary. Step
durations go to a per-instance log indexed by step number, from which a request's token
gaps (and so its TBT) are read when it finishes.

Both kinds call ``on_change(self)`` (when set) after anything that may move what
:meth:`load` returns, other than time passing while :meth:`moving`: the simulator
then reports only those instances (:meth:`Simulator.refresh`).
"""

import math
from collections import deque
from collections.abc import Callable
from heapq import heappop, heappush

import numpy as np

from bus_schemas.load import DecodeLoad, PrefillLoad
from perigee.sim.cluster import Link
from perigee.sim.events import EventLoop
from perigee.sim.pipeline_gang import StageTask
from perigee.sim.request import SimRequest
from services.common.cost_model import CostModel
from services.prefill.queue import PrefillQueue, compute_time

TBT_TOP_FRACTION = 0.10  # paper §7.1: TBT = mean of the longest 10% token gaps


class PrefillInstance:
    """A simulated prefill instance: the live PrefillQueue, timed by the cost model."""

    def __init__(
        self,
        name: str,
        node: str,
        loop: EventLoop,
        cost: CostModel,
        link: Link,
        links: dict[str, Link],
        on_prefilled: Callable[[SimRequest, float], None],
        chunk_tokens: int = 0,
        *,
        handoff_s: float = 0.0,
        on_free: Callable[["PrefillInstance"], None] | None = None,
        reserve: Callable[[SimRequest, "PrefillInstance"], None] | None = None,
    ) -> None:
        self.name, self.node = name, node
        self.loop, self.cost, self.link, self.links = loop, cost, link, links
        self.on_prefilled = on_prefilled
        self.on_free = on_free
        # Takes the request's store slots when its compute starts, then calls compute()
        # or abandon() (None: none to take, compute at once).
        self.reserve = reserve
        self.chunk_tokens = chunk_tokens
        self.handoff_s = handoff_s
        # The live worker's queue (services.prefill.queue): order, admission and price.
        self.queue: PrefillQueue[SimRequest | StageTask] = PrefillQueue(
            cost, loop.clock, chunk_tokens=chunk_tokens
        )
        self.gpu_s = 0.0
        self.done = 0
        self.draining = False  # a P/D switch waits for the queue to empty
        self.on_change: Callable[[PrefillInstance], None] | None = None

    @property
    def running(self) -> SimRequest | StageTask | None:
        return self.queue.running

    @property
    def running_end(self) -> float:
        """When the running work ends (a pipeline sets it once its stage is timed)."""
        return self.queue.running_ends_at()

    @running_end.setter
    def running_end(self, t: float) -> None:
        self.queue.runs_until(t)
        self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self)

    def moving(self) -> bool:
        """Its load moves with time alone (the running work's remainder shrinks)."""
        return self.queue.running is not None

    def push(self, req: SimRequest) -> None:
        req.state = "QUEUED"
        self.queue.push(req)
        self._changed()
        if self.running is None:
            self._start()

    def push_stage(self, task: StageTask) -> None:
        self.queue.push(task)
        self._changed()
        if self.running is None:
            self._start()

    def stage_done(self, task: StageTask) -> None:
        self.gpu_s += task.gang.stage_compute_s(task.stage)
        self.done += 1
        task.gang.stage_done(self, task)
        if self.handoff_s > 0:
            self.loop.after(self.handoff_s, self._free)
        else:
            self._free()

    def __len__(self) -> int:
        return len(self.queue)

    def _start(self) -> None:
        req = self.queue.pop()
        if req is None:
            return
        self._changed()
        if isinstance(req, StageTask):
            req.gang.arrive(req)  # sets running_end once the stages before it are ready
            return
        req.state = "PREFILLING"
        req.started = self.loop.now()
        if self.reserve is None:
            self.compute(req)
        else:
            self.reserve(req, self)

    def compute(self, req: SimRequest) -> None:
        """The running request's slots are held: pull what its node lacks, compute the
        rest (``cached_tokens`` / ``pulled_tokens`` now say what the reservation found)."""
        now = self.loop.now()
        req.compute_s = compute_time(self.cost, req, self.chunk_tokens)
        begin = now
        if req.pulled_tokens:
            begin = self.links[req.pull_source].transfer(req.pulled_tokens, now)
        end = begin + req.compute_s
        self.queue.runs_until(end)
        self._changed()
        self.loop.at(end, self._done, req, begin)

    def abandon(self, req: SimRequest) -> None:
        """The running request's reservation failed: it is gone, take the next."""
        if self.running is req:
            self._free()

    def _done(self, req: SimRequest, compute_start: float) -> None:
        now = self.loop.now()
        self.gpu_s += req.compute_s
        self.done += 1
        req.prefill_end = now
        req.state = "SHIPPING"
        arrive = self.link.ship_overlapped(req.ship_tokens, compute_start, now, self.cost.layers)
        if self.handoff_s > 0:
            self.on_prefilled(req, arrive)
            self.loop.after(self.handoff_s, self._free)
        else:
            self.queue.done(req.rid)
            self._changed()
            self.on_prefilled(req, arrive)
            self._free()

    def _free(self) -> None:
        r = self.running
        if r is not None:
            self.queue.done(r.request_id)
        self._changed()
        if self.on_free is not None:
            self.on_free(self)
        self._start()

    def load(self, now: float) -> PrefillLoad:
        queue_len, tokens, work = self.queue.load()
        return PrefillLoad(
            instance=self.name,
            node=self.node,
            queue_len=queue_len,
            queued_tokens=tokens,
            queued_work_s=work,
            ts=now,
        )


class DecodeInstance:
    """A simulated decode instance: continuous batching timed by the cost model."""

    def __init__(
        self,
        name: str,
        node: str,
        loop: EventLoop,
        cost: CostModel,
        on_finished: Callable[[SimRequest], None],
        max_batch: int = 128,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self.name, self.node = name, node
        self.loop, self.cost = loop, cost
        self.on_finished = on_finished
        self.max_batch = max_batch
        self.waiting: deque[SimRequest] = deque()
        self.running: dict[str, SimRequest] = {}
        self._finish: list[tuple[int, int, SimRequest]] = []  # (finish step, index, req)
        self.base = 0  # sum over running of (context at join - join step)
        self.steps = 0  # step index at the current segment's start
        self.t0 = 0.0  # time of the current segment's start (a step boundary)
        self.seg = 0  # steps in the current segment (0: idle)
        self.alpha = 0.0  # duration of the segment's first step
        self.beta = 0.0  # growth of the step duration per step
        self.gen = 0  # cancels stale segment-end events
        self._log = np.zeros(1024)
        self.tokens = 0
        self.draining = False
        self.on_change: Callable[[DecodeInstance], None] | None = None

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self)

    def moving(self) -> bool:
        """Its load moves with time alone (the running batch's context grows per step)."""
        return self.seg > 0

    # ------------------------------------------------------------ requests

    def add(self, req: SimRequest) -> None:
        """The request's KV has landed (its first token is out already): queue it for a slot."""
        req.state = "DECODING"
        if req.output_tokens <= 1:
            self._finished(req, [])
            return
        self.waiting.append(req)
        self._changed()
        if not self.running and self.seg == 0:
            self.t0 = self.loop.now()
            self._boundary()
        elif len(self.running) < self.max_batch:
            self._cut()

    def __len__(self) -> int:
        return len(self.running) + len(self.waiting)

    # ------------------------------------------------------------ segments

    def _elapsed(self, k: int) -> float:
        return k * self.alpha + self.beta * k * (k - 1) / 2

    def _steps_by(self, t: float) -> int:
        """Steps of the current segment complete at time ``t``."""
        d = t - self.t0
        kmax = self.seg
        if kmax == 0:
            return 0
        if self.alpha <= 0:
            return kmax  # zero-time steps (speedup inf): all done at once
        if d <= 0:
            return 0
        if self.beta <= 0:
            k = int(d / self.alpha)
        else:
            b1 = self.alpha - self.beta / 2
            k = int((-b1 + math.sqrt(b1 * b1 + 2 * self.beta * d)) / self.beta)
        k = min(max(k, 0), kmax)
        while k < kmax and self._elapsed(k + 1) <= d:
            k += 1
        while k > 0 and self._elapsed(k) > d:
            k -= 1
        return k

    def _cut(self) -> None:
        """A request arrived mid-segment with room in the batch: end the segment at the
        next step boundary, where it joins."""
        now = self.loop.now()
        k = self._steps_by(now)
        if self._elapsed(k) < now - self.t0:
            k += 1  # the step in progress finishes first
        k = min(k, self.seg)
        if k == self.seg:
            return  # the pending segment end is that boundary
        self.seg = k
        self.gen += 1
        self._changed()
        self.loop.at(self.t0 + self._elapsed(k), self._segment_end, self.gen)

    def _segment_end(self, gen: int) -> None:
        if gen != self.gen:
            return
        k = self.seg
        if k:
            end = self.steps + k
            if end > len(self._log):
                grown = np.zeros(max(end, 2 * len(self._log)))
                grown[: self.steps] = self._log[: self.steps]
                self._log = grown
            self._log[self.steps : end] = self.alpha + self.beta * np.arange(k)
            self.t0 += self._elapsed(k)
            self.steps = end
            self.tokens += k * len(self.running)
            self._changed()
        self._boundary()

    def _boundary(self) -> None:
        """At a step boundary: retire finished requests, admit waiting ones, plan the
        next segment."""
        s, now = self.steps, self.t0
        fin = self._finish
        while fin and fin[0][0] <= s:
            _, _, req = heappop(fin)
            del self.running[req.rid]
            self.base -= req.num_tokens + 1 - req.join_step
            self._finished(req, self._gaps(req))
        while self.waiting and len(self.running) < self.max_batch:
            req = self.waiting.popleft()
            req.join_step, req.join_time = s, now
            self.running[req.rid] = req
            self.base += req.num_tokens + 1 - s
            heappush(fin, (s + req.output_tokens - 1, req.index, req))
        self.seg = 0
        self._changed()
        if not self.running:
            return
        b = len(self.running)
        ctx = self.base + b * s
        self.alpha = self.cost.decode_step_time(b, ctx)
        self.beta = max(0.0, self.cost.decode_step_time(b, ctx + b) - self.alpha)
        self.seg = fin[0][0] - s
        self.gen += 1
        self.loop.at(now + self._elapsed(self.seg), self._segment_end, self.gen)

    def _gaps(self, req: SimRequest) -> np.ndarray:
        j, n = req.join_step, req.output_tokens - 1
        gaps = self._log[j : j + n].copy()
        gaps[0] += req.join_time - req.first_token  # waiting for a slot, then the first step
        return gaps

    def _finished(self, req: SimRequest, gaps) -> None:
        req.finished = self.loop.now()
        req.tbt_s = top_mean(gaps, TBT_TOP_FRACTION) if len(gaps) else -1.0
        req.state = "DONE"
        self.on_finished(req)

    # ------------------------------------------------------------ reports

    def load(self, now: float) -> DecodeLoad:
        b = len(self.running)
        k = self._steps_by(now) if self.seg else 0
        kv = self.base + b * (self.steps + k) if b else 0
        return DecodeLoad(
            instance=self.name,
            node=self.node,
            batch_size=b,
            waiting=len(self.waiting),
            max_batch=self.max_batch,
            kv_tokens=kv,
            step_time_s=self.cost.decode_step_time(b, kv),
            ts=now,
        )


def top_mean(values, fraction: float) -> float:
    """Mean of the largest ``ceil(fraction * len)`` values (at least one)."""
    n = len(values)
    m = max(1, math.ceil(fraction * n - 1e-9))
    if m >= n:
        return float(np.mean(values))
    part = np.partition(np.asarray(values), n - m)[n - m :]
    return float(part.mean())
