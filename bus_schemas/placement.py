"""Conductor -> prefill -> decode: the tasks that carry a placed request.

A PrefillTask names both transactions: the prefill node's (prefix blocks locked,
new blocks allocated) and the decode node's (a slot for every block the request
has). Prefill writes new KV into its node's slots layer by layer and has its store
ship each layer into the decode node's slots; then it hands a DecodeTask with the
first token to the decode instance. Decode emits the first token and sends
FirstTokenNotice to the conductor, which commits the prefill transaction.
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


class FirstTokenNotice(Msg, tag="first_token"):
    request_id: str
    prefill_node: str
    prefill_tx_id: str
    ts: float


class RequestFailed(Msg, tag="failed"):
    """A worker gave up on a request; the conductor rolls its transactions back."""

    request_id: str
    prefill_node: str
    prefill_tx_id: str
    reason: str


ConductorEvent = FirstTokenNotice | RequestFailed
