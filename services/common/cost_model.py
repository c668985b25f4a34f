"""The paper's analytic cost model (eq. 1, Table 1), used by the mock engine to
decide how long to sleep, by the conductor to estimate TTFT, and by the simulator.

flops(n) = l * (a*n^2*d + b*n*d^2); a prefix hit of p tokens saves flops(p).
KV size of n tokens = n * l * (2*d/gqa) * s. Decode is memory-bound: one step reads
the weights once plus every token of context in the batch, plus a per-sequence cost
(sampling, scheduling, attention launch) of ``decode_seq_s`` per running request::

    step(batch, ctx) = (weight_bytes + kv_bytes(ctx)) / hbm_bw + batch * decode_seq_s

``decode_seq_s`` defaults to 0 (the memory-bound model alone); a profile fitted by
:mod:`services.common.cost_fit` measures it. Transfer time is the KV bytes plus the
bytes already in flight on the link, over the NIC bandwidth.
"""

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class CostModel:
    """The paper's analytic cost model (eq. 1): prefill, decode-step and transfer times."""

    layers: int = 80
    d: int = 8192
    a: float = 4.0
    b: float = 22.0
    gqa: int = 8
    elem_bytes: int = 2
    gpu_flops: float = 8 * 312e12  # G
    h2d_bw: float = 128e9  # B_h2d, bytes/s
    nic_bw: float = 800e9 / 8  # B_nic, bytes/s
    hbm_bw: float = 8 * 2.039e12  # A800 HBM2e, bytes/s
    weight_bytes: float = 70e9 * 2
    # Per running sequence per decode step, seconds (0: purely memory-bound).
    decode_seq_s: float = 0.0
    # Divides every time the model returns; math.inf means "no compute at all".
    speedup: float = 1.0

    @classmethod
    def llama3_70b_a800(cls, speedup: float = 1.0) -> "CostModel":
        return cls(speedup=speedup)

    def with_speedup(self, speedup: float) -> "CostModel":
        return replace(self, speedup=speedup)

    def _scale(self, seconds: float) -> float:
        return 0.0 if math.isinf(self.speedup) else seconds / self.speedup

    def prefill_flops(self, n: int) -> float:
        return self.layers * (self.a * n * n * self.d + self.b * n * self.d * self.d)

    def prefill_time(self, n: int, prefix: int = 0) -> float:
        """Seconds to prefill ``n`` prompt tokens of which ``prefix`` are cached."""
        prefix = min(max(prefix, 0), n)
        return self._scale((self.prefill_flops(n) - self.prefill_flops(prefix)) / self.gpu_flops)

    def kv_bytes(self, tokens: float) -> float:
        return tokens * self.layers * (2 * self.d / self.gqa) * self.elem_bytes

    def load_bw(self) -> float:
        return min(self.h2d_bw, self.nic_bw)

    def transfer_time(self, tokens: int, inflight_bytes: float = 0.0) -> float:
        """KV of ``tokens`` over the node's link, behind ``inflight_bytes`` already queued."""
        return self._scale((self.kv_bytes(tokens) + inflight_bytes) / self.nic_bw)

    def decode_tbt(self, batch_size: float, context_tokens: float, max_batch: int = 0) -> float:
        """The token interval sequences see when ``batch_size`` of them (running and
        waiting) share an instance that steps at most ``max_batch`` at a time: past the
        cap they take turns, ``ceil(batch / max_batch)`` steps of the smaller batch per
        token. Without the cap a queue behind a full batch would look free."""
        if max_batch <= 0 or batch_size <= max_batch:
            return self.decode_step_time(batch_size, context_tokens)
        rounds = math.ceil(batch_size / max_batch)
        return rounds * self.decode_step_time(batch_size / rounds, context_tokens / rounds)

    def tbt_joining(
        self,
        running: int,
        waiting: int,
        kv_tokens: int,
        num_tokens: int,
        max_batch: int = 0,
        seqs: int = 1,
    ) -> float:
        """The TBT rule every decision uses (placement, Early Rejection, the decode-side
        check): the token interval on an instance with ``running`` + ``waiting``
        sequences holding ``kv_tokens`` of context once a request of ``num_tokens``
        joins. A request with n sequences (OpenAI's ``n``) joins as ``seqs`` = n
        sequences of ``num_tokens`` each. The engine holds one copy of the prompt's KV,
        loaded once from the one copy in the store into pages the n sequences share,
        but a step's attention reads a sequence's pages for that sequence (paged
        attention; no shared-prefix kernel on the CPU backend), so a step reads the
        prompt's KV n times: the step time's ``context_tokens`` are what it reads, not
        what the engine holds."""
        return self.decode_tbt(running + waiting + seqs, kv_tokens + seqs * num_tokens, max_batch)

    def decode_step_time(self, batch_size: float, context_tokens: float) -> float:
        """One decode step of ``batch_size`` sequences holding ``context_tokens`` in all
        (fractional values are fine: predictions average over requests)."""
        if batch_size <= 0:
            return 0.0
        t = (self.weight_bytes + self.kv_bytes(context_tokens)) / self.hbm_bw
        if self.decode_seq_s:
            t += batch_size * self.decode_seq_s
        return self._scale(t)
