"""perigee.kv.events.<node>: what a store holds, as a sequenced stream.

Shape follows vLLM's ``kv_events``: a batch carries a per-node sequence number and
the node's epoch (changes on restart). A consumer that sees a gap, or a new epoch,
asks that node for a dump (``store_ctl(node, "dump")``) and rebuilds.
"""

from bus_schemas._base import Msg


class BlockStored(Msg, tag="stored"):
    """Blocks that became readable on the node."""

    block_hashes: list[int]


class BlockRemoved(Msg, tag="removed"):
    """Blocks the node no longer holds on any tier."""

    block_hashes: list[int]


class AllBlocksCleared(Msg, tag="cleared"):
    """The node dropped every block: consumers forget all they knew of it."""

    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(Msg):
    """One sequenced batch of a node's KV events; a gap in ``seq`` or a new ``epoch`` means dump."""

    node: str
    epoch: int
    seq: int
    ts: float
    events: list[KVEvent]
