"""Who may publish and subscribe what on the bus: one NATS user per service, each with an
allow-list of the subjects its role uses (derived from :mod:`bus_schemas.subjects`),
rendered as nats-server config. Nothing is allowed that is not listed; SECURITY.md ("Bus")
states the same lists in prose.

- A worker (prefill or decode instance) subscribes to its own tasks, pipeline stages,
  stats and the broadcast cancel (and the role switches when it is switchable); it
  publishes its own load report and reconnect notice, decode hand-offs (prefill), the
  placing conductor's events, reservations on the stores (prefill: any node's
  ``tx.allocate/renew/abort``; decode: its own node's ``tx.renew/commit/abort``) and the
  replies to a client: the gateway's ``perigee.gw.<gw>.<rid>`` and bus clients'
  ``_INBOX.>``, which it may publish to but never read.
- A store subscribes to its own node's control subjects only (``clear``, ``dump``,
  ``replay``, ``obj.*``, ``tx.*``, ``info``), every store's announce, discovery and the
  replication control; it publishes its own node's KV events and its own node's
  announce (``perigee.store.<node>.announce``: a receiver believes a StoreInfo only on
  its node's subject), and the three requests replication makes of another store
  (``tx.allocate``, ``tx.commit``, ``obj.stat``).
- Store administration (``clear``, ``replay``, ``obj.remove``, ``obj.replicate``,
  ``perigee.ctl.kv.replicate``) is the admin's alone; the conductor may ``dump`` (it
  rebuilds its prefix index from it) and settle transactions (``tx.commit/abort``).
- Only the gateway (and the admin) may read ``perigee.gw.>``, publish the intake and the
  cancels; only admission forwards to the conductors; only the conductor places work and
  switches roles.
- Each login reads only its own inbox, ``_INBOX.<user>.>`` (services.common.bus sets the
  client's inbox prefix from its login), so no login reads another's replies; admission
  and the conductor read their intake consumers' deliveries
  (``_INBOX.perigee-deliver.<queue group>``). A service answers a request through the
  reply subject it came with (``allow_responses``).
- Reconnect notices name their sender in the subject,
  ``perigee.bus.reconnected.<kind>.<id>`` (:func:`bus_schemas.subjects.bus_reconnected`),
  and each login may publish only its own.
- The JetStream API per role: the gateway none (its intake publishes are plain
  publishes, acked by the stream); admission creates the INTAKE and SCHEDULE streams and
  consumes INTAKE (its durable consumer, acks); the conductor creates SCHEDULE, PLACED
  and KV_EVENTS, consumes SCHEDULE (durable) and KV_EVENTS (ordered), claims on PLACED
  and reads claims back; a store creates KV_EVENTS and purges it (its own node's
  subject, a filter in the request that permissions cannot see). A worker has none.

On Kubernetes, pods come and go with scaling, so serving pods have no static user: each
logs in as ``worker-<pod>`` or ``store-<pod>`` with its projected ServiceAccount token,
and the auth callout (services.authn) answers with the same allow-lists for that pod's
instance and node (both the pod's name). The per-instance rules hold per pod there too.

The admin user (``perigee``) may do everything: ``perigee up``'s readiness checks, the
operator's tools, the tests. Passwords are drawn per run (:func:`new_password`).
"""

import json
import secrets
import sys
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
class User:
    name: str
    password: str
    publish: tuple[str, ...] = ()
    subscribe: tuple[str, ...] = ()
    admin: bool = False


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
            *REPLIES,  # Accepted, rejections
            s.bus_reconnected("conductor", ident),
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
        return [*own, s.gateway_replies("*"), f"{s.NS}.gw.*", s.LOAD_ALL, s.BUS_RECONNECTED]
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
                out += [s.prefill_tasks(inst), s.cpp_stage(inst, "*")]
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


def new_password() -> str:
    return secrets.token_urlsafe(24)  # URL-safe: it may ride in a nats:// URL


def users(d: Deployment, passwords: dict[str, str] | None = None) -> list[User]:
    """The admin and one user per member; ``passwords`` (name -> password) where given,
    else new ones."""
    pw = dict(passwords or {})
    out = [User(ADMIN, pw.get(ADMIN) or new_password(), admin=True)]
    for m in d.members:
        out.append(
            User(
                m.name,
                pw.get(m.name) or new_password(),
                tuple(publish_allow(m, d)),
                tuple(subscribe_allow(m, d)),
            )
        )
    return out


def _q(items) -> str:
    return "[" + ", ".join(json.dumps(i) for i in items) + "]"


def render(
    us: list[User],
    *,
    env_passwords: bool = False,
    env_users: bool = False,
    callout_issuer: str = "",
) -> str:
    """An ``authorization`` block for nats-server. ``env_passwords``: each password is
    ``$<NAME>_NATS_PASSWORD`` (upper case, ``-`` as ``_``) from the server's environment,
    as compose passes them; ``env_users``: each user name ``$<NAME>_NATS_USER`` too (the
    Kubernetes Secret names them). A user may answer any request it receives
    (``allow_responses``: one reply to each, within a minute), besides its lists.
    ``callout_issuer``: any other login is decided by the auth callout whose answers this
    key signs (services.authn); the users listed here bypass it."""
    lines = ["authorization {", "  users: ["]
    for u in us:
        pw = f"${env_var(u.name)}" if env_passwords else json.dumps(u.password)
        name = f"${env_var(u.name, 'USER')}" if env_users else json.dumps(u.name)
        if u.admin:
            lines.append(f"    {{user: {name}, password: {pw}}}")
            continue
        lines.append(f"    {{user: {name}, password: {pw},")
        lines.append(f"     permissions: {{publish: {{allow: {_q(u.publish)}}},")
        lines.append(f"                   subscribe: {{allow: {_q(u.subscribe)}}},")
        lines.append("                   allow_responses: true}}")
    lines.append("  ]")
    if callout_issuer:
        names = [f"${env_var(u.name, 'USER')}" if env_users else json.dumps(u.name) for u in us]
        lines += [
            "  auth_callout {",
            f"    issuer: {callout_issuer}",
            f"    auth_users: [{', '.join(names)}]",
            "  }",
        ]
    lines.append("}")
    return "\n".join(lines) + "\n"


def env_var(name: str, what: str = "PASSWORD") -> str:
    return name.upper().replace("-", "_") + "_NATS_" + what


def member(name: str, argv: list[str]) -> Member:
    """The member for a service's command line (``services.<role> ... --instance X``)."""
    role = argv[0].removeprefix("services.")

    def flag(f: str) -> str:
        for i, a in enumerate(argv):
            if a == f and i + 1 < len(argv):
                return argv[i + 1]
            if a.startswith(f + "="):
                return a.split("=", 1)[1]
        return ""

    if role in WORKER_ROLES:
        return Member(name, role, instance=flag("--instance"), node=flag("--node"))
    if role == "store":
        return Member(name, role, node=flag("--node"))
    if role == "conductor":
        return Member(name, role, ident=flag("--id") or "conductor-0")
    return Member(name, role)


# The services of compose.yaml (one node of each serving role).
COMPOSE = Deployment(
    [
        Member("gateway", "gateway"),
        Member("admission", "admission"),
        Member("conductor", "conductor", ident="conductor-0"),
        Member("prefill-0", Role.PREFILL, instance="prefill-0", node="p0"),
        Member("decode-0", Role.DECODE, instance="decode-0", node="d0"),
        Member("store-p0", "store", node="p0"),
        Member("store-d0", "store", node="d0"),
    ]
)


def compose_authorization() -> str:
    """deploy/nats.conf's authorization block (tests/unit/perigee/test_compose.py holds them
    equal): passwords from each server's environment."""
    return render(
        users(COMPOSE, {u: "-" for u in [ADMIN, *(m.name for m in COMPOSE.members)]}),
        env_passwords=True,
    )


# Kubernetes (deploy/k8s): the control plane logs in with one static user per role; a
# serving pod logs in as worker-<pod> / store-<pod> with its projected ServiceAccount
# token, and the auth callout (services.authn) grants it that pod's own subjects (the
# workers switch roles in place, hence switchable). So every per-instance rule holds
# per pod there too.
K8S = Deployment(
    [
        Member("gateway", "gateway"),
        Member("admission", "admission"),
        Member("conductor", "conductor"),
        Member("authn", "authn"),
    ],
    switchable=True,
)
AUTHN_ISSUER_ENV = "AUTHN_ISSUER"  # the callout's public key, in the NATS servers' env


def k8s_authorization() -> str:
    """deploy/k8s/base/nats.conf's authorization block (tests/unit/perigee/test_k8s_manifests.py
    holds them equal): names and passwords from the Secret, through each server's env;
    every other login goes to the auth callout."""
    return render(
        users(K8S, {u: "-" for u in [ADMIN, *(m.name for m in K8S.members)]}),
        env_passwords=True,
        env_users=True,
        callout_issuer=f"${AUTHN_ISSUER_ENV}",
    )


if __name__ == "__main__":
    print(k8s_authorization() if sys.argv[1:] == ["k8s"] else compose_authorization(), end="")
