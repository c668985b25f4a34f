"""Conductor -> prefill -> decode: the tasks that carry a placed request.

A PrefillTask names both transactions: the prefill node's (prefix blocks locked,
new blocks allocated) and the decode node's (a slot for every block the request
has). Prefill writes new KV into its node's slots layer by layer and has its store
ship each layer into the decode node's slots. The first token goes to the client as
soon as prefill has computed it (``stream_first_token``), while the KV is still on
the wire, as the paper's TTFT (queue + prefill) assumes; once every layer is acked,
prefill hands a DecodeTask with that token to the decode instance and sends
FirstTokenNotice to the conductor, which commits the prefill transaction (its slots
are no longer read). Decode streams from the second token on.
"""

from bus_schemas._base import Msg
from bus_schemas.control import TxHandle
from bus_schemas.requests import GenerateRequest


class RemotePrefix(Msg):
    """Blocks the prefill node must pull from another node before computing."""

    source_node: str
    source_tx: TxHandle  # SOURCE transaction on the holder: the blocks are locked there
    first_block: int  # index in the request's block list of the first block to pull
    num_blocks: int


class PrefillTask(Msg):
    request: GenerateRequest
    conductor_id: str
    prefill_instance: str
    decode_instance: str
    prefill_tx: TxHandle
    decode_tx: TxHandle
    remote: RemotePrefix | None = None
    placed_ts: float = 0.0
    # Conductor's own estimate, for the latency breakdown and the simulator's cross-check.
    est_ttft_s: float = 0.0
    # False: the decode instance emits the first token once the KV has landed (the
    # paper's baseline admission, which may still reject the request at decode).
    stream_first_token: bool = True


class DecodeTask(Msg):
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


class FirstTokenNotice(Msg, tag="first_token"):
    request_id: str
    prefill_node: str
    prefill_tx_id: str
    ts: float  # the first token was computed (unix seconds)
    handoff_ts: float = 0.0  # the DecodeTask went out (0: same as ts)


class RequestFailed(Msg, tag="failed"):
    """A worker gave up on a request; the conductor rolls its transactions back."""

    request_id: str
    prefill_node: str
    prefill_tx_id: str
    reason: str


ConductorEvent = FirstTokenNotice | RequestFailed
