"""Chunked pipeline parallelism (paper §3.3): pipeline timing and prefill groups.

Pure: no clock, no I/O. The placement policy asks :func:`pipeline_timing` what a
request would cost on a group of X prefill instances, each holding 1/X of the layers,
and compares it with the single instances (Algorithm 1 then takes the argmin).

The prompt's uncached suffix ``[prefix, n)`` is cut into chunks of at most
``chunk_tokens``. Chunk k on stage s starts when stage s is done with chunk k-1 (or,
for the first chunk, once the member is free: ``ready[s]``) and chunk k's activations
(``tokens * d * elem_bytes``) have crossed the link from stage s-1; it computes the
stage's share of the chunk, ``cost_s.prefill_time(b, a) / X``::

    end[k][s] = max(end[k][s-1] + handoff(k), end[k-1][s], ready[s]) + chunk_time(k) / X

The first token is out when the last stage finishes the last chunk (fill, then steady
state over the chunks). A request of one chunk gains nothing (X stages of 1/X each,
plus X-1 hand-offs) and its group waits for its busiest member, so Algorithm 1 keeps
it on a single instance: short requests never pay for the group.

Groups (``--cpp-group X``): every X live prefill instances in name order form one
(:func:`form_groups`), as the paper groups every X nodes of the prefill pool. There is
no barrier: each member takes its stage's chunks as its own queue reaches them, and a
busy downstream member only delays the chunks behind it (upstream stages run ahead,
their activations wait). The placement books member s from its ``ready[s]`` until its
last chunk is done (:func:`member_work`) until a load report covers it.

A member is held one chunk at a time, not for its whole stage: a request placed on it
meanwhile runs between two of the pipeline's chunks and stretches the stage by its
compute. Algorithm 1 lets only short requests do that (at most
``CppConfig.interleave_tokens`` computed): they see a member's queue as its report
shows it (the chunk in progress); a longer request, and another group, also count
the member's stages still to run. Holding a member for its whole stage cost the
requests that are never pipelined up to 21% of their TTFT (``BENCHMARKS.md``, CPP).

Stage order: the member free first is stage 0, the busiest last (:func:`order_stages`),
so a busy member's wait overlaps the stages before it instead of holding them idle.

The prefix cache counts: the member whose node holds the longest cached prefix is the
anchor (its store takes the request's blocks, as a single instance's would); the other
stages read their layers' slice of that prefix from the anchor's store before they
start, ``(X-1)/X`` of its KV over the anchor's link (:func:`slice_tokens`).
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.common.cost_model import CostModel

DEFAULT_CHUNK_TOKENS = 4096
# Below this many computed tokens a request is not offered to a group: a group holds X
# instances for the whole pipeline, so a small gain in one TTFT would cost the requests
# queued behind them more than it saves (the paper pipelines only above a threshold).
DEFAULT_MIN_TOKENS = 65536
# Requests computing at most this many tokens are placed on a pipeline's member as if
# the pipeline were not there: they run between two of its chunks and stretch its stage
# by their compute. Longer ones would stretch it by seconds: they count its stages
# still to run as queued work. 8k (two chunks) keeps the prompts under 8k tokens no
# slower than without groups and a 64k+ prompt at 0.39x on a group of 4 (4k: 0.385x
# but 8k-16k prompts 2% slower; 16k: 0.42x), ``perigee sim repro cpp``.
DEFAULT_INTERLEAVE_TOKENS = 8192


@dataclass(frozen=True)
class CppConfig:
    """Chunked pipeline parallelism's settings: group size, chunk size and interleaving."""

    group_size: int = 1  # X; 1: no groups
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS  # the paper's prefill_chunk
    min_tokens: int = DEFAULT_MIN_TOKENS  # computed tokens below which no group is tried
    # Requests computing at most this many tokens run on a member between two of a
    # pipeline's chunks; longer ones wait for its stage (see the module's docstring).
    interleave_tokens: int = DEFAULT_INTERLEAVE_TOKENS

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise ValueError(f"cpp group size must be >= 1, not {self.group_size}")
        if self.chunk_tokens < 1:
            raise ValueError(f"cpp chunk_tokens must be >= 1, not {self.chunk_tokens}")

    @property
    def enabled(self) -> bool:
        return self.group_size > 1


@dataclass(frozen=True)
class PipelineTiming:
    """Seconds from the pipeline's start (every member free, prefix slices loaded)."""

    chunks: tuple[tuple[int, int], ...]  # token ranges [a, b) of the computed suffix
    stage_end_s: tuple[float, ...]  # when stage s has finished its last chunk
    stage_start_s: tuple[float, ...]  # when stage s starts its first chunk
    stage_compute_s: tuple[float, ...]  # compute seconds stage s spends
    handoff_s: tuple[float, ...]  # per chunk, one stage boundary's activation transfer

    @property
    def ttft_s(self) -> float:
        return self.stage_end_s[-1]

    @property
    def stages(self) -> int:
        return len(self.stage_end_s)


def chunk_bounds(n: int, prefix: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """The computed tokens ``[prefix, n)`` in chunks of at most ``chunk_tokens``; the
    last prompt token is always computed (its logits give the first token)."""
    if chunk_tokens < 1:
        raise ValueError("chunk_tokens must be >= 1")
    a = min(max(prefix, 0), max(n - 1, 0))
    out = []
    while a < n:
        b = min(n, a + chunk_tokens)
        out.append((a, b))
        a = b
    return out


def activation_bytes(cost: CostModel, tokens: int) -> float:
    """Hidden states of ``tokens`` at a stage boundary: one d-vector per token."""
    return float(tokens) * cost.d * cost.elem_bytes


def handoff_time(cost: CostModel, tokens: int) -> float:
    """One stage boundary's transfer of ``tokens`` activations over the NIC."""
    return cost.transfer_time(0, activation_bytes(cost, tokens))


def pipeline_timing(
    costs: Sequence[CostModel],
    n: int,
    prefix: int,
    chunk_tokens: int,
    link: CostModel | None = None,
    ready: Sequence[float] | None = None,
    parts: int | None = None,
) -> PipelineTiming:
    """Timing of a prompt of ``n`` tokens (``prefix`` cached) over ``len(costs)``
    stages, stage s computing with ``costs[s]`` (each instance's fitted model) from
    ``ready[s]`` on (default 0); the hand-offs run on ``link`` (default ``costs[0]``).
    Each stage computes ``1/parts`` of the layers (default: ``1/len(costs)``; the
    first stages of a longer pipeline are timed with ``parts`` = its length)."""
    x = len(costs)
    if x < 1:
        raise ValueError("a pipeline needs at least one stage")
    link = link or costs[0]
    parts = parts or x
    chunks = chunk_bounds(n, prefix, chunk_tokens)
    end = list(ready) if ready is not None else [0.0] * x
    if len(end) != x:
        raise ValueError("one ready time per stage")
    start: list[float | None] = [None] * x
    compute = [0.0] * x
    handoffs = []
    for a, b in chunks:
        h = handoff_time(link, b - a)
        handoffs.append(h)
        arrives = 0.0  # the chunk's input at stage s
        for s in range(x):
            t = costs[s].prefill_time(b, a) / parts
            begin = max(arrives, end[s])
            if start[s] is None:
                start[s] = begin
            end[s] = begin + t
            compute[s] += t
            arrives = end[s] + h
    return PipelineTiming(
        chunks=tuple(chunks),
        stage_end_s=tuple(end),
        stage_start_s=tuple(0.0 if v is None else v for v in start),
        stage_compute_s=tuple(compute),
        handoff_s=tuple(handoffs),
    )


def member_work(queues: Sequence[float], timing: PipelineTiming) -> list[float]:
    """Seconds each member is held by the pipeline after its queued work (``queues``,
    the ``ready`` times the timing was computed with): until its stage is done."""
    return [e - q for q, e in zip(queues, timing.stage_end_s, strict=True)]


def ready_times(queues: Sequence[float], slices_s: float, anchor: int) -> list[float]:
    """When each stage can start: its member's queued work, and for the stages other
    than the anchor (stage index ``anchor``) the prefix slices read from it."""
    return [q if s == anchor else max(q, slices_s) for s, q in enumerate(queues)]


def form_groups(instances: Sequence[str], size: int) -> list[tuple[str, ...]]:
    """Every ``size`` instances in name order form a group; a remainder forms none."""
    if size <= 1:
        return []
    ordered = sorted(instances)
    return [tuple(ordered[i : i + size]) for i in range(0, len(ordered) - size + 1, size)]


def anchor_of(members: Sequence[str], node_of: Mapping[str, str], own: Mapping[str, int]) -> str:
    """The member whose node holds the longest cached prefix (ties: by name)."""
    return min(members, key=lambda m: (-own.get(node_of[m], 0), m))


def order_stages(
    members: Sequence[str], queues: Mapping[str, float], anchor: str = ""
) -> tuple[str, ...]:
    """Pipeline order: by queued work, the least busy first; on a tie the anchor
    first (it needs no slices), then by name."""
    return tuple(sorted(members, key=lambda m: (queues[m], m != anchor, m)))


def slice_tokens(prefix_tokens: int, stages: int) -> float:
    """Prefix KV (in tokens' worth) the non-anchor stages read from the anchor."""
    return prefix_tokens * (stages - 1) / stages
