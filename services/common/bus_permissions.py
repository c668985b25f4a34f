"""Who may publish and subscribe what on the bus, per role: the allow-lists of subjects
(derived from :mod:`bus_schemas.subjects`) that perigee.natsauth renders as nats-server
config and the auth callout (services.authn) grants per pod. SECURITY.md ("Bus") states
the same lists in prose; perigee.natsauth's docstring says what each role gets and why."""

from dataclasses import dataclass, field

from bus_schemas import subjects as s
from bus_schemas.roles import ROLES as WORKER_ROLES
from bus_schemas.roles import Role

ADMIN = "perigee"
REPLIES = [s.gateway_replies("*"), "_INBOX.>"]  # where a client's stream goes
# Stream names (services.common.intake_queue, services.common.kv_stream).
INTAKE_STREAM, SCHEDULE_STREAM, PLACED_STREAM = (
    "PERIGEE_INTAKE",
    "PERIGEE_SCHEDULE",
    "PERIGEE_PLACED",
)
KV_STREAM = "PERIGEE_KV_EVENTS"
AUTH_CALLOUT = "$SYS.REQ.USER.AUTH"  # where nats-server asks the auth callout
ROLES = ("gateway", "admission", "conductor", Role.PREFILL, Role.DECODE, "store")


def inbox(user: str) -> str:
    """The inbox prefix of ``user``'s connections (services.common.bus.connect)."""
    return f"_INBOX.{user}"


def deliveries(group: str) -> str:
    """Where an intake queue's durable consumer delivers (services.common.intake_queue)."""
    return f"_INBOX.perigee-deliver.{group}"


def _stream_admin(*streams: str) -> list[str]:
    """Create a stream, bring it to its configuration, read its state."""
    return [f"$JS.API.STREAM.{op}.{st}" for st in streams for op in ("CREATE", "UPDATE", "INFO")]


def _durable(stream: str, name: str) -> list[str]:
    """Look up, create and consume a durable push consumer ``name`` on ``stream``."""
    return [
        f"$JS.API.CONSUMER.INFO.{stream}.{name}",
        f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{name}",
        f"$JS.API.CONSUMER.CREATE.{stream}.{name}",
        f"$JS.API.CONSUMER.CREATE.{stream}.{name}.>",
        f"$JS.ACK.{stream}.{name}.>",
    ]


@dataclass(frozen=True)
class Member:
    """One service of the deployment: its user name, role, and instance or node."""

    name: str
    role: str
    instance: str = ""  # prefill/decode: the worker instance (e.g. decode-0); "": any
    node: str = ""  # store, worker: its node (e.g. d0); "": any
    ident: str = ""  # conductor: its id (its events subject); "": any


@dataclass
class Deployment:
    """Every service of a deployment, from which each role's allow-lists are made."""

    members: list[Member] = field(default_factory=list)
    switchable: bool = False  # workers change role (RoleSwitch): either role's subjects

    def instances(self) -> list[str]:
        return [m.instance for m in self.members if m.instance]

    def nodes(self) -> list[str]:
        return [m.node for m in self.members if m.node]


def _worker_roles(m: Member, d: Deployment) -> tuple[str, ...]:
    return tuple(WORKER_ROLES) if d.switchable else (m.role,)


def publish_allow(m: Member, d: Deployment) -> list[str]:
    inst, node, ident = m.instance or "*", m.node or "*", m.ident or "*"
    if m.role == "gateway":
        return [
            s.REQUESTS,
            s.INTAKE,
            s.CANCEL,
            f"{s.NS}.gw.>",  # its echo (perigee.gw.<gw>) and its own streams
            s.bus_reconnected("gateway", "*"),
        ]
    if m.role == "admission":
        return [
            s.SCHEDULE,
            s.SCHEDULE_QUEUE,
            *REPLIES,  # rejections
            s.bus_reconnected("admission", "*"),
            s.presence("admission", "*"),
            *_stream_admin(INTAKE_STREAM, SCHEDULE_STREAM),
            *_durable(INTAKE_STREAM, s.Q_ADMISSION),
        ]
    if m.role == "conductor":
        return [
            s.prefill_tasks("*"),
            s.CTL_ROLE,
            s.placed("*"),
            s.STORE_DISCOVER,
            *(s.store_ctl("*", ep) for ep in ("tx.commit", "tx.abort", "dump")),
            # a placement's first reservation round, sent ahead of its task (the stores
            # answer the prefill instance: services.prefill.reserve_ahead)
            s.store_ctl("*", "tx.allocate"),
            *REPLIES,  # Accepted, rejections
            s.bus_reconnected("conductor", ident),
            s.presence("conductor", ident),
            *_stream_admin(SCHEDULE_STREAM, PLACED_STREAM, KV_STREAM),
            *_durable(SCHEDULE_STREAM, s.Q_CONDUCTOR),
            f"$JS.API.STREAM.MSG.GET.{PLACED_STREAM}",  # a claim read back
            # The ordered consumer that replays the KV events (created, reset, and its
            # flow control answered).
            f"$JS.API.CONSUMER.CREATE.{KV_STREAM}",
            f"$JS.API.CONSUMER.CREATE.{KV_STREAM}.>",
            f"$JS.API.CONSUMER.DELETE.{KV_STREAM}.*",
            f"$JS.FC.{KV_STREAM}.>",
        ]
    if m.role in WORKER_ROLES:
        out: list[str] = []
        for role in _worker_roles(m, d):
            out.append(s.load_report(role, inst))
            if role == Role.PREFILL:
                out += [
                    s.decode_tasks("*"),  # the hand-off to the placed decode instance
                    s.cpp_stage("*", "*"),  # a pipeline's anchor drives its stages
                    # reservations on the prefill, decode and source nodes
                    *(s.store_ctl("*", ep) for ep in ("tx.allocate", "tx.renew", "tx.abort")),
                ]
            else:  # the decode tx is on its own node; the answer's write-back goes there
                # and on to the prefill node holding the prompt (services.decode.writeback)
                out += [
                    s.store_ctl(node, "tx.renew"),
                    *(s.store_ctl("*", ep) for ep in ("tx.allocate", "tx.commit", "tx.abort")),
                ]
        return [
            *dict.fromkeys(out),
            s.store_ctl(node, "info"),
            s.conductor_events("*", inst),  # the subject names it: the conductor checks
            *REPLIES,  # tokens, errors
            s.bus_reconnected("worker", inst),
        ]
    if m.role == "authn":  # answers the servers' login questions, nothing else
        return [s.bus_reconnected("authn", "*")]
    if m.role == "store":
        return [
            s.kv_events(node),
            s.store_announce(node),  # its own node's only: receivers check the subject
            # what replication asks of another store
            *(s.store_ctl("*", ep) for ep in ("tx.allocate", "tx.commit", "obj.stat")),
            s.bus_reconnected("store", node),
            *_stream_admin(KV_STREAM),
            f"$JS.API.STREAM.PURGE.{KV_STREAM}",  # its previous epoch's batches
        ]
    raise ValueError(f"unknown role {m.role!r}")


def subscribe_allow(m: Member, d: Deployment) -> list[str]:
    inst, node, ident = m.instance or "*", m.node or "*", m.ident or "*"
    own = [f"{inbox(m.name)}.>"]
    if m.role == "gateway":
        return [
            *own,
            s.gateway_replies("*"),
            f"{s.NS}.gw.*",
            s.LOAD_ALL,
            s.BUS_RECONNECTED,
            s.PRESENCE_ALL,
        ]
    if m.role == "admission":
        return [
            *own,
            s.REQUESTS,
            s.LOAD_PREFILL_ALL,
            s.LOAD_DECODE_ALL,
            s.CTL_ROLE,
            deliveries(s.Q_ADMISSION),
        ]
    if m.role == "conductor":
        return [
            *own,
            s.SCHEDULE,
            s.conductor_events(ident),
            s.conductor_events_from_workers(ident),
            s.LOAD_PREFILL_ALL,
            s.LOAD_DECODE_ALL,
            s.CTL_ROLE,
            s.KV_EVENTS_ALL,
            s.STORE_ANNOUNCE,
            deliveries(s.Q_CONDUCTOR),
        ]
    if m.role in WORKER_ROLES:
        out = [*own, s.CANCEL]
        for role in _worker_roles(m, d):
            out.append(s.worker_stats(role, inst))
            if role == Role.PREFILL:
                out += [s.prefill_tasks(inst), s.cpp_stage(inst, "*"), s.prefill_reserved(inst)]
            else:
                out.append(s.decode_tasks(inst))
        if d.switchable:
            out.append(s.CTL_ROLE)
        return out
    if m.role == "authn":
        return [*own, AUTH_CALLOUT]
    if m.role == "store":
        # The other stores' announcements: the node registry its ships may go to.
        return [*own, s.store_ctl(node, ">"), s.STORE_DISCOVER, s.STORE_ANNOUNCE, s.CTL_REPLICATE]
    raise ValueError(f"unknown role {m.role!r}")
