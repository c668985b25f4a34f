"""The durable copy of every node's KV events: one JetStream stream over
``perigee.kv.events.>`` (issue 13 item 4).

A store publishes each :class:`EventBatch` to the stream with ``Nats-Msg-Id``
``<node>.<epoch>.<seq>`` (a retried publish is stored once) and, when it starts a new
epoch, purges its subject of the previous incarnation's batches: what the stream holds
per node is its current epoch, oldest first, so a conductor that starts reads it from
the beginning and rebuilds its index without asking any store; the stream keeps at most
:data:`MAX_MSGS_PER_NODE` batches per node, and a conductor whose replay starts past
``seq 1`` asks that node for a dump (the index's gap rule). Core subscribers on the same
subjects keep getting each batch as before: JetStream stores a publish, it does not
take it away from them.

:class:`CatchUp` (pure) tells a replaying consumer when it reached the stream's end as
it was at subscription: batches before that are history (no sign that their store is
alive), batches after it are live.
"""

import structlog
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError

from bus_schemas import subjects
from services.common.bus import js_replicas

log = structlog.get_logger()

STREAM = "PERIGEE_KV_EVENTS"
MAX_MSGS_PER_NODE = 20_000


def config(replicas: int | None = None) -> StreamConfig:
    return StreamConfig(
        name=STREAM,
        subjects=[subjects.KV_EVENTS_ALL],
        retention=RetentionPolicy.LIMITS,
        discard=DiscardPolicy.OLD,
        max_msgs_per_subject=MAX_MSGS_PER_NODE,
        storage=StorageType.FILE,
        num_replicas=replicas or js_replicas(),
        duplicate_window=120.0,
    )


async def ensure(js: JetStreamContext) -> None:
    """Create the stream, or bring an existing one to this configuration (idempotent: the
    stores and the conductors all call it)."""
    cfg = config()
    try:
        await js.add_stream(cfg)
    except BadRequestError:  # exists with another configuration (e.g. replicas)
        await js.update_stream(cfg)


def msg_id(node: str, epoch: int, seq: int) -> str:
    return f"{node}.{epoch}.{seq}"


class CatchUp:
    """Where a stream replay stands. ``pending`` is what the consumer had to deliver when
    it was created; each delivered message says how many were still behind it."""

    def __init__(self, pending: int) -> None:
        self.done = pending == 0
        self.replayed = 0  # history messages delivered before catching up

    def on_message(self, num_pending: int) -> bool:
        """True if this message is history (delivered before the replay caught up)."""
        if self.done:
            return False
        self.replayed += 1
        if num_pending == 0:
            self.done = True
        return True
