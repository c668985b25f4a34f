"""Store control over NATS request/reply (paper §5.3): TxAllocate / TxCommit / TxAbort,
lease renewal (:class:`TxRenew`), discovery, dumps, replication and role switches.

The node's store is the authority on its blocks. A conductor asks it to lock the
prefix blocks a request will reuse and to allocate slots for the rest
(:class:`TxAllocate`); the store answers with a :class:`TxHandle` or a
:class:`Refused`. After the first token, :class:`TxCommit` publishes the new blocks;
:class:`TxAbort` rolls everything back. A transaction not committed within its
lease is rolled back by the store itself, so a dead conductor leaks nothing.
"""

from enum import IntEnum

from bus_schemas._base import Msg
from bus_schemas.kv_events import EventBatch
from bus_schemas.requests import Retention
from bus_schemas.roles import ROLES, Role


class TxRole(IntEnum):
    """What a store transaction does on its node: a prefill's, a decode's or a source's part."""

    PREFILL = 0  # lock the reusable prefix, allocate the rest, cache on commit
    DECODE = 1  # receive a whole request's KV (tail block included)
    SOURCE = 2  # lock blocks another node will pull; allocates nothing


class TxAllocate(Msg):
    """Lock a request's cached prefix on a node and allocate slots for the rest."""

    request_id: str
    role: TxRole
    block_hashes: list[int]  # full blocks of the prompt, chained
    num_tokens: int  # prompt length; the tail beyond the full blocks gets a slot too
    retention: Retention = Retention.DEFAULT
    context_ttl_s: float = 0.0
    lease_s: float = 30.0
    # A decode worker writing back what its engine generated (the answer's blocks,
    # issue 24): the store counts these blocks, and later hits on them, apart.
    answer: bool = False


class TxHandle(Msg, tag="handle"):
    """An open transaction: its slots on the node, its leading hits, and where its bytes go."""

    tx_id: str
    node: str
    epoch: int
    # One slot per block of the request (tail block included unless role is SOURCE).
    slots: list[int]
    # The first ``hit_blocks`` blocks are already on this node and are locked.
    hit_blocks: int
    shm_name: str
    data_addr: str  # ZeroMQ endpoint of the node's store
    block_bytes: int
    # Unix seconds at which the store rolls the transaction back if it is still open
    # (0: not said); a worker that cannot use the slots by then must give up.
    expires_at: float = 0.0


class Refused(Msg, tag="refused"):
    """A store's no to a control request, with a reason code."""

    reason: str  # "capacity" | "epoch" | "unknown_tx" | "bad_request" ...
    message: str


TxReply = TxHandle | Refused


class TxCommit(Msg):
    """Close a transaction: its newly written blocks become cached and announced."""

    tx_id: str
    request_id: str


class TxAbort(Msg):
    """Roll a transaction back: its locks and unwritten slots are released."""

    tx_id: str
    request_id: str
    reason: str = ""


class TxDone(Msg, tag="done"):
    """A store's yes to a commit, abort or replication, with the blocks it stored."""

    tx_id: str
    stored_blocks: int = 0


TxDoneReply = TxDone | Refused


class TxRenew(Msg):
    """Extend the leases of open transactions on one node: whoever holds a live
    request's slots (the prefill worker from compute start, the decode worker until
    its engine has the KV) renews them, so a request never fails because it waited."""

    tx_ids: list[str]
    lease_s: float
    request_id: str = ""  # for the logs; one renewal may cover several requests


class TxRenewed(Msg):
    """The answer to a TxRenew: the new lease end, and the transactions not open here."""

    expires_at: float  # unix seconds, the new end of every lease named in ``renewed``
    renewed: list[str]
    unknown: list[str]  # not open here (committed, aborted, expired, or another epoch)


class StoreInfo(Msg):
    """A store's announcement of itself: node, epoch, endpoints and capacity."""

    node: str
    epoch: int
    seq: int  # last KV-event sequence number published
    data_addr: str
    shm_name: str
    block_size: int
    block_bytes: int
    capacity_blocks: int
    used_blocks: int
    host: str = ""
    ts: float = 0.0
    # Plain-TCP endpoint for object put/get (tcp://host:port); "" when not served.
    obj_addr: str = ""
    # Unix socket for a same-host worker's SHIP / PULL / LEASE; "" when not served.
    ctl_path: str = ""


class DumpRequest(Msg):
    """Ask a store for every block it holds (a conductor saw a gap or just started)."""

    cursor: int = 0
    limit: int = 50_000


class DumpPage(Msg):
    """One page of a store's block list, consistent with its KV-event ``seq``."""

    node: str
    epoch: int
    seq: int  # sequence number the snapshot is consistent with
    block_hashes: list[int]
    next_cursor: int | None = None


class Replicate(Msg):
    """Copy blocks from one node to another (hot-spot replication, paper §4.2)."""

    block_hashes: list[int]
    source_node: str
    dest_node: str


class RoleSwitch(Msg):
    """Move an instance to another role (``ctl.role``, from the P/D ratio controller)."""

    instance: str
    role: str  # a Role ("prefill" | "decode"); anything else is ignored

    def previous_role(self) -> str | None:
        """The role the instance leaves (None: ``role`` is not a role)."""
        return Role(self.role).other if self.role in ROLES else None


class Presence(Msg):
    """An admission or conductor process is alive (``subjects.presence(kind, name)``,
    every ``interval_s``). On the core path (no durable intake) a request such a
    process holds before it is placed lives only in that process: the gateway resends
    the requests not placed yet when one goes silent, or comes back under a newer
    incarnation (services.gateway.control_presence)."""

    kind: str  # "admission" | "conductor"
    name: str  # unique per kind (the conductor's id, admission's --id)
    incarnation: int
    interval_s: float


# ---- appended for the tiered store (issue 4): wipe, event replay, objects, replicas ----


class ClearRequest(Msg):
    """Wipe a store: every block no open transaction holds goes, on every tier."""

    reason: str = ""


class ClearDone(Msg):
    """A wiped store's answer: what went and what open transactions still hold."""

    node: str
    epoch: int
    seq: int  # the batch that announced the wipe (AllBlocksCleared or BlockRemoved)
    removed_blocks: int
    kept_blocks: int  # still held by open transactions


class ReplayRequest(Msg):
    """Ask a store for its recent event batches with seq > ``after_seq``."""

    after_seq: int = 0
    limit: int = 1000


class ReplayPage(Msg):
    """A store's recent event batches after ``after_seq``, or word that the consumer must dump."""

    node: str
    epoch: int
    seq: int  # the store's latest seq
    # False when batches after ``after_seq`` were already dropped from the replay
    # buffer: the consumer must dump instead.
    complete: bool
    batches: list[EventBatch] = []


class ObjectReplicate(Msg):
    """Make ``dest_node`` hold a copy of object ``key`` taken from ``source_node``."""

    key: str
    source_node: str
    dest_node: str


class ObjectKey(Msg):
    """obj.stat / obj.remove on one store."""

    key: str


class ObjectDone(Msg, tag="object_done"):
    """A store's answer about one object: its node, its size and whether it is there."""

    key: str
    node: str
    size: int = 0
    present: bool = True
    # obj.stat: the blocks holding the value, for a store that copies it (obj.replicate)
    block_hashes: list[int] = []


class BusReconnected(Msg):
    """``perigee.bus.reconnected``: ``client`` (its connection name) lost its NATS server
    and is connected again, to ``server``."""

    client: str
    server: str = ""
