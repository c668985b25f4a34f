"""Conductor -> prefill -> decode: the tasks that carry a placed request.

A PrefillTask names where the request runs (prefill and decode instance and node)
and the prefix the conductor expects to reuse, but holds no store slots: a queued
request reserves nothing. When its compute starts, the prefill instance opens the
transactions itself (services.prefill.reserve): PREFILL on its node (the cached
prefix locked, the rest allocated), DECODE on the decode node, SOURCE on the holder
of a remote prefix (:class:`PrefixSource`), and renews their leases while it works.
Prefill writes new KV into its node's slots layer by layer and has its store ship
each layer into the decode node's slots. The first token goes to the client as
soon as prefill has computed it (``stream_first_token``), while the KV is still on
the wire, as the paper's TTFT (queue + prefill) assumes; once every layer is acked,
prefill hands a DecodeTask (with the decode transaction) to the decode instance and
sends FirstTokenNotice to the conductor, which commits the source transaction and the
prefill one (their slots are no longer read) unless the prefill node's store committed
that with the last ship (``prefill_committed``). Decode streams from the second token on.
"""

from bus_schemas._base import Msg
from bus_schemas.control import TxHandle
from bus_schemas.requests import GenerateRequest, PositionLogprobs


class RemotePrefix(Msg):
    """Blocks the prefill node must pull from another node before computing."""

    source_node: str
    source_tx: TxHandle  # SOURCE transaction on the holder: the blocks are locked there
    first_block: int  # index in the request's block list of the first block to pull
    num_blocks: int


class PrefixSource(Msg):
    """Where the conductor saw a longer prefix than the prefill node holds: the prefill
    instance locks ``[0, first_block + num_blocks)`` there (SOURCE) and pulls what its
    own node lacks."""

    node: str
    first_block: int
    num_blocks: int


class PrefillTask(Msg):
    """A placed request for its prefill instance: where it runs and which prefix it reuses."""

    request: GenerateRequest
    conductor_id: str
    prefill_instance: str
    decode_instance: str
    prefill_node: str
    decode_node: str
    # Leading blocks the conductor expects on this node (its shadow index; the store's
    # TxAllocate has the last word), for the queue's work estimate.
    expected_hit_blocks: int = 0
    source: PrefixSource | None = None
    placed_ts: float = 0.0
    # Conductor's own estimate, for the latency breakdown and the simulator's cross-check.
    est_ttft_s: float = 0.0
    # False: the decode instance emits the first token once the KV has landed (the
    # paper's baseline admission, which may still reject the request at decode).
    stream_first_token: bool = True
    # Chunked pipeline parallelism (services.policy.chunk_timing): the group's instances in
    # pipeline order, this one (the anchor, which holds the request's transactions)
    # among them, and the chunk size. Empty: the instance computes it alone.
    cpp_stages: list[str] = []
    cpp_chunk_tokens: int = 0
    # The incarnations the conductor placed on (0: unknown, any): an instance refuses a
    # task addressed to another incarnation of its name (the one placed on is gone).
    prefill_incarnation: int = 0
    decode_incarnation: int = 0
    # Non-empty: the conductor sent this task's first round of TxAllocates itself as it
    # placed it, the stores answering on subjects.prefill_reserved(instance, this key),
    # so the round trip overlaps the task's way here (services.prefill.reserve_ahead).
    reserved_ahead: str = ""


class DecodeTask(Msg):
    """A prefilled request for its decode instance, with the transaction that holds its KV."""

    request: GenerateRequest
    conductor_id: str
    prefill_instance: str
    prefill_node: str
    prefill_tx_id: str
    decode_tx: TxHandle
    first_token: int
    cached_tokens: int
    prefill_done_ts: float = 0.0
    first_token_sent: bool = False  # prefill already streamed it to the client (index 0)
    decode_incarnation: int = 0  # as PrefillTask's
    # What prefill computed beside the first token, for the decode side to stream with
    # it when prefill did not (the request asked for logprobs).
    first_logprobs: PositionLogprobs | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None


class FirstTokenNotice(Msg, tag="first_token"):
    """Prefill's word to the placing conductor that a request is handed to decode."""

    request_id: str
    prefill_node: str
    prefill_tx_id: str
    ts: float  # the first token was computed (unix seconds)
    handoff_ts: float = 0.0  # the DecodeTask went out (0: same as ts)
    # The prefill node's store committed the prefill transaction with the last ship:
    # the conductor commits only the SOURCE one.
    prefill_committed: bool = False
    source_node: str = ""  # a SOURCE transaction to commit too (hot-spot migration)
    source_tx_id: str = ""


class RequestFailed(Msg, tag="failed"):
    """A worker gave up on a request; the conductor rolls its transactions back."""

    request_id: str
    prefill_node: str
    prefill_tx_id: str
    reason: str


ConductorEvent = FirstTokenNotice | RequestFailed
