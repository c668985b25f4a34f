"""All NATS subject names, in one place.

Layout is ``{namespace}.{component}.{endpoint}``; per-instance subjects put the
instance id before the endpoint so one wildcard subscribes to a whole role.
"""

NS = "perigee"

# Clients (the gateway, or anyone with nats-py) publish a GenerateRequest here with
# a reply subject; every StreamEvent for that request goes to the reply subject.
REQUESTS = f"{NS}.requests"
# admission -> conductor, after the request passed early rejection.
SCHEDULE = f"{NS}.conductor.schedule"
# Crash-safe intake (services.common.intake_queue): JetStream work queues. The gateway
# publishes its requests on INTAKE; admission forwards what it accepted on
# SCHEDULE_QUEUE (REQUESTS and SCHEDULE stay the core-NATS doors for bus clients).
INTAKE = f"{NS}.intake"
SCHEDULE_QUEUE = f"{NS}.conductor.queue"
# A client that gives up (HTTP disconnect) publishes CancelRequest here; every
# prefill and decode worker listens.
CANCEL = f"{NS}.cancel"

# Store discovery: every store publishes its StoreInfo on its own node's subject,
# store_announce(node), periodically and at once when anyone publishes on
# STORE_DISCOVER. STORE_ANNOUNCE subscribes to every node's; the bus lets a store's
# login publish only its own (perigee.natsauth), so a receiver checks the payload's
# node against the subject (announced_by). A discovery has no reply: the answer is the
# announce, which the subject proves (a reply on an inbox proves nothing).
STORE_DISCOVER = f"{NS}.store.discover"

KV_EVENTS_ALL = f"{NS}.kv.events.>"
LOAD_ALL = f"{NS}.load.>"
LOAD_PREFILL_ALL = f"{NS}.load.prefill.>"
LOAD_DECODE_ALL = f"{NS}.load.decode.>"

# A client that lost its NATS server and reconnected to another publishes
# BusReconnected on bus_reconnected(kind, id): what was in flight to or from it in
# between may be lost (core NATS delivers at most once), so the gateway resumes its
# requests in flight. BUS_RECONNECTED subscribes to every sender's notices; the subject's
# last two tokens name the sender (each login may publish only its own: perigee.natsauth).
BUS_RECONNECTED = f"{NS}.bus.reconnected.>"

CTL_REPLICATE = f"{NS}.ctl.kv.replicate"
CTL_ROLE = f"{NS}.ctl.role"

# Queue groups: one per component, so N copies of a service share the work.
Q_ADMISSION = "admission"
Q_CONDUCTOR = "conductor"


def prefill_tasks(instance: str) -> str:
    return f"{NS}.prefill.{instance}.tasks"


def prefill_reserved(instance: str, key: str = "*", role: str = "*") -> str:
    """Where the stores answer the TxAllocates a conductor sent for ``instance`` ahead
    of its task (``PrefillTask.reserved_ahead`` is ``key``; ``role``: prefill, decode,
    source): the reply subject of each, so that only the instance reads them."""
    return f"{NS}.prefill.{instance}.reserved.{key}.{role}"


def cpp_stage(instance: str, op: str) -> str:
    """Where a pipeline's anchor opens (``op`` "open") and runs ("run") ``instance``'s
    stage (bus_schemas.pipeline_stages)."""
    return f"{NS}.prefill.{instance}.cpp.{op}"


def decode_tasks(instance: str) -> str:
    return f"{NS}.decode.{instance}.tasks"


def conductor_events(conductor_id: str, sender: str = "") -> str:
    """Where workers tell the placing conductor that a request's prefill is handed over
    (FirstTokenNotice, from prefill) or that the request failed (RequestFailed): a
    worker on ``<...>.events.<its instance>`` (the bus lets it publish only its own, so
    the subject proves the sender); the bare subject is the admin's (readiness probes)."""
    base = f"{NS}.conductor.{conductor_id}.events"
    return f"{base}.{sender}" if sender else base


def conductor_events_from_workers(conductor_id: str) -> str:
    return f"{NS}.conductor.{conductor_id}.events.*"


def placed(token: str) -> str:
    """A conductor's claim on a request's placement (token: a digest of its id)."""
    return f"{NS}.conductor.placed.{token}"


def store_ctl(node: str, endpoint: str) -> str:
    """Store control endpoints: tx.allocate, tx.commit, tx.abort, dump, info."""
    return f"{NS}.store.{node}.{endpoint}"


def store_announce(node: str) -> str:
    """Where the store of ``node`` announces its StoreInfo (``*``: every node's). It is
    one of the node's own store endpoints, ``perigee.store.<node>.announce``: no other
    role's rights cover it (``perigee.store.announce.<node>`` would fall under
    ``perigee.store.*.dump``, ``perigee.store.*.info``, ...)."""
    return store_ctl(node, "announce")


STORE_ANNOUNCE = store_announce("*")


def announced_by(subject: str, node: str) -> bool:
    """Whether ``subject`` is the announce subject of ``node``: a StoreInfo claiming
    ``node`` is believed only on it (the payload's own name is not enough)."""
    return bool(node) and subject == store_announce(node)


def kv_events(node: str) -> str:
    return f"{NS}.kv.events.{node}"


def load_report(role: str, instance: str) -> str:
    return f"{NS}.load.{role}.{instance}"


def worker_stats(role: str, instance: str) -> str:
    """Request/reply: a worker's counters (tasks, tokens computed, prefix tokens loaded)."""
    return f"{NS}.{role}.{instance}.stats"


def gateway_reply(gateway_id: str, request_id: str) -> str:
    """The per-request stream subject a gateway sets as the NATS reply of a GenerateRequest."""
    return f"{NS}.gw.{gateway_id}.{request_id}"


def gateway_replies(gateway_id: str) -> str:
    """One wildcard subscription covers every stream of a gateway."""
    return f"{NS}.gw.{gateway_id}.>"


def presence(kind: str, name: str) -> str:
    """Where an admission or conductor process (``kind``) named ``name`` beats
    (bus_schemas.control.Presence): the gateway resends the requests a dead one may have
    held before placing them (services.gateway.control_presence). The bus lets a login
    publish only its own kind's (perigee.natsauth)."""
    return f"{NS}.presence.{kind}.{name}"


PRESENCE_ALL = f"{NS}.presence.>"


def bus_reconnected(kind: str, sender: str) -> str:
    """Where ``sender`` (a worker's instance, a store's node, a conductor's id, ...; of
    ``kind`` "worker", "store", "conductor", "admission", "gateway" or "client") says it
    reconnected. The bus lets a login publish only its own (perigee.natsauth)."""
    return f"{NS}.bus.reconnected.{kind}.{sender}"


def named_by(subject: str, claimed: str) -> bool:
    """Whether a per-instance (or per-node) ``subject`` (its last token names the sender:
    load reports, KV events) names ``claimed``, the instance or node the payload claims
    to be from. The bus lets a login publish only its own subjects (perigee.natsauth),
    so the subject is the proof and the payload's own name is not enough."""
    return subject.rsplit(".", 1)[-1] == claimed
