"""Mooncake trace files (``timestamp`` ms, ``input_length``, ``output_length``,
``hash_ids`` of 512-token prefix-chained blocks) and prompts built from them.

Prompts are built the way NVIDIA aiperf builds its ``mooncake_trace`` dataset: one
block of tokens per hash id, the same id always giving the same tokens, the last
block cut to make ``input_length``. ``scale`` shrinks every length (block size too)
for small models while keeping the sharing structure.
"""

import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

DEFAULT_TRACE = Path(__file__).resolve().parents[1] / "data" / "conversation_trace.jsonl"
TRACE_BLOCK = 512


@dataclass(frozen=True)
class TraceRequest:
    """One request of the Mooncake trace: arrival time, lengths and block hash ids."""

    timestamp_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str | Path = DEFAULT_TRACE, limit: int | None = None) -> list[TraceRequest]:
    out = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            out.append(
                TraceRequest(
                    r["timestamp"] / 1000.0,
                    int(r["input_length"]),
                    int(r["output_length"]),
                    tuple(r["hash_ids"]),
                )
            )
            if limit and len(out) >= limit:
                break
    return out


class PromptBuilder:
    """Token ids for a trace request: ``block_tokens`` tokens per hash id."""

    def __init__(
        self,
        block_tokens: int = TRACE_BLOCK,
        vocab_size: int = 1024,
        first_token: int = 3,
        seed: int = 0,
    ) -> None:
        self.block_tokens = block_tokens
        self.vocab_size = vocab_size
        self.first_token = first_token  # skip special tokens (<unk>, <s>, </s>)
        self.seed = seed
        self._cache: dict[int, np.ndarray] = {}

    def block(self, hash_id: int) -> np.ndarray:
        b = self._cache.get(hash_id)
        if b is None:
            rng = np.random.default_rng([self.seed, hash_id])
            b = rng.integers(self.first_token, self.vocab_size, self.block_tokens, dtype=np.int64)
            self._cache[hash_id] = b
        return b

    def input_length(self, req: TraceRequest) -> int:
        """``input_length`` scaled from 512-token blocks to this builder's block size."""
        scaled = -(-req.input_length * self.block_tokens // TRACE_BLOCK)
        return max(1, min(scaled, len(req.hash_ids) * self.block_tokens))

    def tokens(self, req: TraceRequest) -> list[int]:
        n = self.input_length(req)
        parts = [self.block(h) for h in req.hash_ids]
        return np.concatenate(parts)[:n].tolist() if parts else [self.first_token] * n


def spread_ties(reqs: list[TraceRequest]) -> list[TraceRequest]:
    """The same requests with ties in ``timestamp_s`` spread evenly over their step.

    Mooncake's traces stamp arrivals in steps (3 s in the conversation trace: every
    request of a step has the same timestamp), so the order in which one step's
    requests reach a live stack is down to task scheduling, run to run. Here the k
    requests stamped T arrive at ``T + i * (T' - T) / k`` (i = 0..k-1, in file order),
    T' the next distinct timestamp (the last step gets the median step); the mean rate
    is unchanged and the order is well defined for a live replay and a simulation alike.
    """
    if not reqs:
        return []
    stamps = sorted({r.timestamp_s for r in reqs})
    steps = sorted(b - a for a, b in zip(stamps, stamps[1:], strict=False))
    last_step = steps[len(steps) // 2] if steps else 0.0
    after = dict(zip(stamps, [*stamps[1:], stamps[-1] + last_step], strict=True))
    out: list[TraceRequest] = []
    i = 0
    while i < len(reqs):
        t = reqs[i].timestamp_s
        j = i
        while j < len(reqs) and reqs[j].timestamp_s == t:
            j += 1
        gap = (after[t] - t) / (j - i)
        out += [replace(r, timestamp_s=t + k * gap) for k, r in enumerate(reqs[i:j])]
        i = j
    return out
