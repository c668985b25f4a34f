"""perigee.requests and the per-request reply subject.

A client publishes :class:`GenerateRequest` to ``subjects.REQUESTS`` with a NATS
reply subject. Everything that happens to the request afterwards arrives on that
subject as a :data:`StreamEvent`: ``accepted``, then ``tokens`` (one or more),
then exactly one of ``finished`` or ``error``.
"""

from enum import IntEnum

import msgspec

from bus_schemas._base import Msg


class Retention(IntEnum):
    DEFAULT = 0  # LRU
    EPHEMERAL = 1  # new blocks are not cached (paper §5.2: web-search content)
    CONTEXT_CACHE = 2  # pinned for ``context_ttl_s``; offloaded, never evicted while pinned


class ErrorCode(IntEnum):
    BAD_REQUEST = 400
    CANCELLED = 499
    REJECTED = 429
    INTERNAL = 500
    UNAVAILABLE = 503  # a worker died or no instance of a role is up
    TIMEOUT = 504


class SamplingParams(Msg):
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False


class GenerateRequest(Msg):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = SamplingParams()
    # Chained hashes of the full blocks of the prompt. Admission fills them in
    # (services.common.hashing) when a client leaves them out.
    block_size: int = 0
    block_hashes: list[int] | None = None
    model: str = ""
    retention: Retention = Retention.DEFAULT
    context_ttl_s: float = 0.0
    # Per-request SLO overrides (seconds); None means the deployment's default.
    ttft_slo_s: float | None = None
    tbt_slo_s: float | None = None
    arrival_ts: float = 0.0  # unix seconds at the gateway
    # Where StreamEvents go. Empty means "the NATS reply subject of the message".
    reply_subject: str = ""


class Accepted(Msg, tag="accepted"):
    request_id: str
    prefill_instance: str
    decode_instance: str
    cached_tokens: int = 0


class Tokens(Msg, tag="tokens"):
    request_id: str
    token_ids: list[int]
    index: int  # position of token_ids[0] among the generated tokens
    # Sent by the prefill instance (the first token, ahead of the KV handoff): the
    # request is not on its decode instance yet.
    from_prefill: bool = False


class Finished(Msg, tag="finished"):
    request_id: str
    finish_reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class Error(Msg, tag="error"):
    request_id: str
    code: ErrorCode
    message: str
    retry_after_s: float | None = None


StreamEvent = Accepted | Tokens | Finished | Error


class CancelRequest(Msg):
    request_id: str
    reason: str = "client disconnected"


def stream_event_decoder() -> msgspec.json.Decoder:
    return msgspec.json.Decoder(StreamEvent)
