"""One trace request as it moves through the simulator, and what happened to it.

ARRIVED -> (admission Reject) REJECTED "admission"
        -> (placement Rejection) REJECTED "conductor"
        -> QUEUED on a prefill instance -> PREFILLING (store slots reserved first;
           no room after the wait, or a store refusing otherwise: REJECTED "prefill")
        -> SHIPPING (KV to decode)
        -> (baseline: decode over its TBT SLO) REJECTED "decode" (prefill wasted)
        -> DECODING (first token out) -> DONE
"""

from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False, slots=True)
class SimRequest:
    """One trace request as it moves through the simulator, and what happened to it."""

    rid: str
    index: int
    arrival: float
    num_tokens: int  # prompt tokens
    output_tokens: int  # completion tokens, the first one included
    hashes: list[int]  # full-block hashes
    state: str = "ARRIVED"
    prefill_instance: str = ""
    prefill_node: str = ""
    decode_instance: str = ""
    decode_node: str = ""
    cached_tokens: int = 0  # prompt tokens whose KV was reused (local hit + pulled)
    pulled_tokens: int = 0
    pull_source: str = ""
    ship_tokens: int = 0  # tokens whose KV goes to the decode node
    compute_s: float = 0.0  # prefill GPU time
    started: float = -1.0
    prefill_end: float = -1.0
    first_token: float = -1.0
    finished: float = -1.0
    tbt_s: float = -1.0  # mean of the longest 10% token gaps (-1: fewer than 2 tokens)
    reject_stage: str = ""
    reject_reason: str = ""
    txs: dict[str, tuple[str, Any]] = field(default_factory=dict)  # role -> (node, Allocation)
    source: Any = None  # the placement's PrefixSource (a longer prefix elsewhere), or None
    want: set[str] = field(default_factory=set)  # roles still to reserve
    reserve_until: float = -1.0  # give up waiting for room then
    # decode bookkeeping (set by the decode instance)
    join_step: int = -1
    join_time: float = -1.0

    # What services.prefill.queue.PrefillQueue reads of a queued request (QueueItem).
    @property
    def request_id(self) -> str:
        return self.rid

    @property
    def prompt_tokens(self) -> int:
        return self.num_tokens

    @property
    def prefix_tokens(self) -> int:
        return self.cached_tokens

    @property
    def stage_work_s(self) -> float | None:
        return None

    @property
    def ttft_s(self) -> float:
        return self.first_token - self.arrival if self.first_token >= 0 else -1.0
