"""perigee.requests and the per-request reply subject.

A client publishes :class:`GenerateRequest` to ``subjects.REQUESTS`` with a NATS
reply subject. Everything that happens to the request afterwards arrives on that
subject as a :data:`StreamEvent`: ``accepted``, then ``tokens`` (one or more),
then exactly one of ``finished`` or ``error``.
"""

import math
from enum import IntEnum

import msgspec

from bus_schemas._base import Msg


class Retention(IntEnum):
    """How a store keeps a request's new blocks (paper §5.2)."""

    DEFAULT = 0  # LRU
    EPHEMERAL = 1  # new blocks are not cached (paper §5.2: web-search content)
    CONTEXT_CACHE = 2  # pinned for ``context_ttl_s``; offloaded, never evicted while pinned


class ErrorCode(IntEnum):
    """Why a request ended in an Error; the values are the HTTP statuses the gateway answers."""

    BAD_REQUEST = 400
    CANCELLED = 499
    REJECTED = 429
    INTERNAL = 500
    UNAVAILABLE = 503  # a worker died or no instance of a role is up
    TIMEOUT = 504


INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_LOGPROBS = 20  # vLLM's default max_logprobs (and OpenAI's top_logprobs bound)
LOGIT_BIAS_RANGE = 100.0  # vLLM clamps a bias to [-100, 100]
MAX_BAD_WORDS = 128  # vLLM's VLLM_MAX_NUM_BAD_WORDS
# Sequences per request (``n``). vLLM sets no bound of its own but max_num_seqs; each
# sequence is a decode slot, and the decode instance's batch (128 by default) must hold
# them all at once.
MAX_N = 16

# One position's log-probabilities: ``[token id, logprob]`` pairs in vLLM's order (the
# token at that position first, then the most likely ones by rank), each logprob clamped
# at -9999 as vLLM's OpenAI server does (JSON has no -inf).
PositionLogprobs = list[tuple[int, float]]


class StructuredOutput(Msg):
    """A constraint on the answer, applied by vLLM's structured-output backend on both
    roles (its ``StructuredOutputsParams``): exactly one of ``json`` (a JSON schema, as
    JSON text), ``regex``, ``choice``, ``grammar`` (EBNF/Lark) or ``json_object``.

    ``answer_start``: where the answer begins in ``prompt_token_ids`` when the prompt
    already holds part of it (a migrated request: the gateway sets it to the original
    prompt's length); 0: the prompt holds none. Each engine feeds the answer so far
    (prefill: ``prompt[answer_start:]``; decode: that plus the first token) to the
    grammar before it samples, so the constraint resumes where it was."""

    json: str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    answer_start: int = 0

    def kinds(self) -> int:
        return sum(
            (
                self.json is not None,
                self.regex is not None,
                self.choice is not None,
                self.grammar is not None,
                self.json_object,
            )
        )


class SamplingParams(Msg):
    """How to sample; :meth:`problem` holds the bounds (vLLM's ``SamplingParams`` and its
    OpenAI server's), checked by the gateway, admission and the engine wrapper alike."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    # Passed to vLLM on both roles. ``min_tokens`` counts from the first token (prefill's);
    # the engine wrapper splits it between the roles. ``bad_words_token_ids`` are the
    # gateway's tokenization of ``bad_words`` (the engines load no tokenizer), as vLLM's
    # ``SamplingParams.update_from_tokenizer`` makes them.
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] = []
    # Log-probabilities: None off; k >= 0 the sampled token's plus the k most likely, per
    # generated token (``logprobs``) or prompt token (``prompt_logprobs``, prefill only).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: StructuredOutput | None = None
    # Sequences sampled from the one prompt (OpenAI's ``n``). Prefill computes the
    # prompt's KV once and samples sequence 0's first token; the decode instance runs
    # every sequence on that KV, shipped once (services.decode.worker). Sequence i's
    # seed is ``seed + i``, as vLLM's parallel sampling gives its children.
    n: int = 1

    def problem(self) -> tuple[str, str] | None:
        """``(field, message)`` for the first value out of bounds, None when all are in.

        JSON integers are unbounded and msgspec keeps them so; the engine packs them
        into int32/int64 tensors and a torch generator, where an overflow raised inside
        a step would take the whole engine down (a seed of 2**70 did)."""
        if not 1 <= self.max_tokens <= INT32_MAX:
            return "max_tokens", f"max_tokens must be in [1, {INT32_MAX}], got {self.max_tokens}"
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= 2.0):
            return "temperature", f"temperature must be in [0, 2], got {self.temperature}"
        if not 0.0 < self.top_p <= 1.0:  # NaN fails too
            return "top_p", f"top_p must be in (0, 1], got {self.top_p}"
        if self.seed is not None and not INT64_MIN <= self.seed <= INT64_MAX:
            return "seed", f"seed must be a 64-bit signed integer, got {self.seed}"
        bad = next((t for t in self.stop_token_ids if not 0 <= t <= INT32_MAX), None)
        if bad is not None:
            return "stop_token_ids", f"stop token id {bad} is out of range"
        if not -1 <= self.top_k <= INT32_MAX:
            return "top_k", f"top_k must be -1 or 0 (off), or in [1, {INT32_MAX}], got {self.top_k}"
        if not 0.0 <= self.min_p <= 1.0:
            return "min_p", f"min_p must be in [0, 1], got {self.min_p}"
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            return "repetition_penalty", (
                f"repetition_penalty must be a finite number above 0, got {self.repetition_penalty}"
            )
        if not 1 <= self.n <= MAX_N:
            return "n", f"n must be in [1, {MAX_N}], got {self.n}"
        if self.n > 1 and self.seed is not None and self.seed + self.n - 1 > INT64_MAX:
            return "seed", f"seed + n - 1 must be a 64-bit signed integer, got {self.seed}"
        return self._problem_extra()

    def seq_seed(self, seq: int) -> int | None:
        """The seed of sequence ``seq`` (vLLM's ``ParentRequest``: ``seed + index``)."""
        return None if self.seed is None else self.seed + seq

    def _problem_extra(self) -> tuple[str, str] | None:
        if not 0 <= self.min_tokens <= self.max_tokens:
            return "min_tokens", (
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        for t, b in (self.logit_bias or {}).items():
            if not 0 <= t <= INT32_MAX:
                return "logit_bias", f"logit_bias token id {t} is out of range"
            if not (math.isfinite(b) and abs(b) <= LOGIT_BIAS_RANGE):
                return "logit_bias", f"logit_bias values must be in [-100, 100], got {b}"
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                return "allowed_token_ids", "allowed_token_ids must not be empty"
            if any(not 0 <= t <= INT32_MAX for t in self.allowed_token_ids):
                return "allowed_token_ids", "allowed_token_ids has an id out of range"
        if len(self.bad_words_token_ids) > MAX_BAD_WORDS:
            return "bad_words", f"at most {MAX_BAD_WORDS} bad words (after tokenization)"
        for w in self.bad_words_token_ids:
            if not w or any(not 0 <= t <= INT32_MAX for t in w):
                return "bad_words", "a bad word has no tokens or a token id out of range"
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                return name, f"{name} must be in [0, {MAX_LOGPROBS}], got {k}"
        so = self.structured
        if so is not None:
            if so.kinds() != 1:
                return "structured_outputs", "exactly one kind of structured output is allowed"
            if so.choice is not None and not so.choice:
                return "structured_outputs", "a choice constraint needs at least one choice"
            if so.answer_start < 0:
                return "structured_outputs", "answer_start must not be negative"
        return None

    def token_ids_used(self) -> list[int]:
        """Every token id these parameters name (each must be in the model's vocabulary)."""
        return [
            *self.stop_token_ids,
            *(self.logit_bias or ()),
            *(self.allowed_token_ids or ()),
            *(t for w in self.bad_words_token_ids for t in w),
        ]


class Migration(Msg):
    """Marks a GenerateRequest that continues an accepted request whose prefill or decode
    instance died (the gateway resends it; services.gateway.resend). Its prompt is
    the original prompt followed by the ``resumed_tokens`` tokens the client already
    has, so placement finds the prompt's KV in the stores and only the rest is
    recomputed. Admission passes it through (it was accepted once) and the conductor
    places it without SLO rejection, away from ``dead_instance``."""

    of_request_id: str  # the client's request id
    attempt: int  # 1 for the first migration
    reason: str  # "decode_died" | "prefill_died"
    dead_instance: str
    resumed_tokens: int  # generated tokens appended to the prompt
    prompt_tokens: int  # length of the original prompt
    dead_request_id: str = ""  # the attempt that died (the client's id on a first migration)
    # The incarnation that died (0: unknown). A restarted process under the same name is
    # a new instance: the conductor excludes the name only while that incarnation reports.
    dead_incarnation: int = 0
    # The instance did not die: it kept reporting but made no progress on the request
    # (the gateway watchdog's wedge verdict). The conductor avoids it while another
    # instance of its role is live, and places there again when it is the only one:
    # waiting for another that may never come would fail a request a live instance can
    # still serve (a single-card stack whose engines stalled each other: BENCHMARKS.md).
    wedged: bool = False


class GenerateRequest(Msg):
    """One request to generate: prompt tokens, sampling, retention and SLOs."""

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
    migration: Migration | None = None  # set on a resent request (issue 13)
    # Sent on the core doors (perigee.requests -> perigee.conductor.schedule) because the
    # durable intake did not store it in time (a JetStream stream electing a leader
    # after a nats-server died): admission and the conductor keep it off JetStream too.
    core_path: bool = False
    # The client takes a stream's last tokens inside its Finished (``Finished.tokens``,
    # ``unbundled``): one message fewer a request. The gateway asks for it.
    finish_with_tokens: bool = False


class Accepted(Msg, tag="accepted"):
    """The request is placed, on these instances. The conductor sends it before the
    placement's task, so the workers' events follow it on one nats-server; across a
    cluster (each service's connection on its own server) it may arrive after them."""

    request_id: str
    prefill_instance: str
    decode_instance: str
    cached_tokens: int = 0
    # The incarnations placed on (0: unknown): a later one under the same name means the
    # placed process died, and the gateway migrates the request at once.
    prefill_incarnation: int = 0
    decode_incarnation: int = 0
    # The conductor's TTFT estimate (queue + prefill): the gateway's progress watchdog
    # judges a prefill that stays silent far beyond it wedged.
    est_ttft_s: float = 0.0


class Tokens(Msg, tag="tokens"):
    """Generated tokens in order from ``index``, with their log-probabilities when asked."""

    request_id: str
    token_ids: list[int]
    index: int  # position of token_ids[0] among the generated tokens
    # Sent by the prefill instance (the first token, ahead of the KV handoff): the
    # request is not on its decode instance yet.
    from_prefill: bool = False
    incarnation: int = 0  # the sending worker's incarnation
    # One entry per token of token_ids when the request asked for ``logprobs``.
    logprobs: list[PositionLogprobs] | None = None
    # With the first token (index 0) when it asked for ``prompt_logprobs``: one entry per
    # prompt position, None for the first (nothing precedes it).
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # Which of the request's ``n`` sequences these tokens belong to; ``index`` counts
    # within that sequence.
    seq: int = 0
    # With the prefill's first token: the seconds of its wait the engine accounts for
    # (the instance's queue, the cached prefix's load, the compute). The rest of the
    # gateway's wait is the control plane's (services.gateway.lateness).
    engine_s: float | None = None


class Finished(Msg, tag="finished"):
    """The last stream event of a request that completed, with its token counts."""

    request_id: str
    finish_reason: str  # "stop" | "length" | "abort" (sequence 0's when n > 1)
    prompt_tokens: int
    completion_tokens: int  # of every sequence
    cached_tokens: int
    # n > 1: each sequence's finish reason and completion tokens, by sequence.
    seq_finish: list[str] = []
    seq_tokens: list[int] = []
    # The stream's last tokens when they came at its end, for a request that asked
    # (``GenerateRequest.finish_with_tokens``): counted in completion_tokens, taken
    # before the end (``unbundled``).
    tokens: Tokens | None = None


class Error(Msg, tag="error"):
    """The last stream event of a request that failed; a rejection says when to retry."""

    request_id: str
    code: ErrorCode
    message: str
    retry_after_s: float | None = None


StreamEvent = Accepted | Tokens | Finished | Error


def unbundled(ev: StreamEvent) -> tuple[StreamEvent, ...]:
    """The events ``ev`` stands for, in order: a Finished that carries the last tokens
    is those Tokens, then the Finished without them."""
    if type(ev) is Finished and ev.tokens is not None:
        return ev.tokens, msgspec.structs.replace(ev, tokens=None)
    return (ev,)


class CancelRequest(Msg):
    """Stop a request. Published on ``subjects.CANCEL`` (every worker listens); the
    instances named in ``targets`` (instance -> incarnation) answer the NATS reply with
    :class:`CancelAck`, and the sender repeats it until each has answered or its
    incarnation ended. A worker acts on a cancel naming it under another incarnation not
    at all: the request it names belonged to a process that is gone."""

    request_id: str
    reason: str = "client disconnected"
    targets: dict[str, int] = {}


class CancelAck(Msg):
    """A worker's answer to a :class:`CancelRequest` that named it: ``refused`` when the
    cancel was addressed to another incarnation of the instance (nothing was done)."""

    request_id: str
    instance: str
    incarnation: int
    held: bool = False  # the request was running or queued here and is being stopped
    refused: bool = False


def stream_event_decoder() -> msgspec.json.Decoder[StreamEvent]:
    return msgspec.json.Decoder(StreamEvent)
