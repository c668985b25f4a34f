"""The n sequences of one request (OpenAI's ``n``) on a decode instance. Pure.

Prefill computed the prompt's KV once, sampled sequence 0's first token and shipped
the KV once into this node's store (one DECODE transaction). Sequence 0 decodes as any
request does. Each sequence i > 0 is one more engine request on the same slots, in
sequence 0's group (``DecodeJob.prefix_group``: the request id). The worker adds
sequence 0 first and the others once the engine has its KV, so they share the
prompt's pages (vLLM's prefix cache) and the slots are read once; an engine that
cannot share loads the KV from the slots again (still no ship, no store read over the
network). Each computes the prompt's last position again (vLLM: the partial block
after the shared ones) and samples its own first token with seed ``seed + i`` (vLLM's
parallel sampling: a child's generator starts fresh from its seed, so sequence i's
tokens are those of vLLM's child i).
"""

from collections.abc import Sequence

import msgspec

from bus_schemas.requests import GenerateRequest
from services.common.kv_layout import KVLayout
from services.engine import DecodeJob, SlotKV


def seq_id(request_id: str, seq: int) -> str:
    """The engine's id of sequence ``seq`` (sequence 0 keeps the request's)."""
    return request_id if seq == 0 else f"{request_id}/seq{seq}"


def ids(request_id: str, n: int) -> list[str]:
    return [seq_id(request_id, i) for i in range(max(1, n))]


def more_jobs(
    req: GenerateRequest, slots: Sequence[memoryview], layout: KVLayout
) -> list[DecodeJob]:
    """The DecodeJobs of sequences 1 .. n-1 (no first token, no write-back: the answer
    blocks of sequence 0 alone go to the store)."""
    s, n = req.sampling, len(req.prompt_token_ids)
    return [
        DecodeJob(
            request_id=seq_id(req.request_id, i),
            prompt_token_ids=req.prompt_token_ids,
            first_token=None,
            sampling=msgspec.structs.replace(s, seed=s.seq_seed(i), n=1),
            kv=SlotKV(layout, slots, n),
            seq=i,
            prefix_group=req.request_id,
        )
        for i in range(1, s.n)
    ]
