"""Who may publish and subscribe what on the bus: one NATS user per service, with subject
permissions derived from :mod:`bus_schemas.subjects`, rendered as nats-server config.

Every role may use the ``perigee.>`` namespace, inboxes and the JetStream API, less what
is not its business (a deny wins over an allow in nats-server):

- intake (``perigee.requests``) is published by the gateway (and the operator), and
  ``perigee.conductor.schedule`` by admission; a worker or a store may subscribe to
  neither (in the queue group it would steal requests);
- a worker's control subjects: prefill tasks and role switches come only from the
  conductor, decode tasks from prefill workers and the conductor; nobody publishes
  another instance's load reports or answers its stats, and only a store publishes its
  own node's KV events;
- the gateway and admission reach no store and command no worker;
- the crash-safe intake (services.common.intake_queue): ``perigee.intake`` is the
  gateway's, ``perigee.conductor.queue`` admission's, the placement claims the
  conductors'; a worker or a store may neither publish there nor touch those streams
  through the JetStream API (a consumer of its own would take requests off the queue).

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
ALL = f"{s.NS}.>"
INBOX = "_INBOX.>"
JETSTREAM = ["$JS.API.>", "$JS.ACK.>", "$JS.FC.>"]
ROLES = ("gateway", "admission", "conductor", Role.PREFILL, Role.DECODE, "store")

_TASKS = [s.prefill_tasks("*"), s.decode_tasks("*")]
_CTL = f"{s.NS}.ctl.>"
_KV_EVENTS = f"{s.NS}.kv.events.>"
_LOAD = f"{s.NS}.load.>"
_STORES = f"{s.NS}.store.>"
_INTAKE = [s.INTAKE, s.SCHEDULE_QUEUE, s.placed("*")]
# The JetStream API on the intake streams: $JS.API.STREAM.<op>.<stream>,
# $JS.API.STREAM.MSG.GET.<stream>, $JS.API.CONSUMER.<op>.<stream>[.<consumer>...] and
# $JS.API.CONSUMER.{MSG.NEXT,DURABLE.CREATE}.<stream>.<consumer>.
_INTAKE_API = [
    p.format(st)
    for st in ("PERIGEE_INTAKE", "PERIGEE_SCHEDULE", "PERIGEE_PLACED")
    for p in (
        "$JS.API.STREAM.*.{}",
        "$JS.API.STREAM.*.*.{}",
        "$JS.API.CONSUMER.*.{}",
        "$JS.API.CONSUMER.*.{}.>",
        "$JS.API.CONSUMER.*.*.{}.>",
    )
]


@dataclass(frozen=True)
class User:
    name: str
    password: str
    pub_deny: tuple[str, ...] = ()
    sub_deny: tuple[str, ...] = ()
    admin: bool = False


@dataclass(frozen=True)
class Member:
    """One service of the deployment: its user name, role, and instance or node."""

    name: str
    role: str
    instance: str = ""  # prefill/decode: the worker instance (e.g. decode-0)
    node: str = ""  # store: its node (e.g. d0)


@dataclass
class Deployment:
    members: list[Member] = field(default_factory=list)
    switchable: bool = False  # workers change role (RoleSwitch): decode may hand off too

    def instances(self) -> list[str]:
        return [m.instance for m in self.members if m.instance]

    def nodes(self) -> list[str]:
        return [m.node for m in self.members if m.node]


def publish_deny(m: Member, d: Deployment) -> list[str]:
    if m.role == "gateway":
        return [f"{s.NS}.conductor.>", *_TASKS, _CTL, _STORES, _KV_EVENTS, _LOAD]
    if m.role == "admission":
        return [s.REQUESTS, s.INTAKE, s.placed("*"), *_TASKS, _CTL, _STORES, _KV_EVENTS, _LOAD]
    if m.role == "conductor":
        return [s.REQUESTS, s.INTAKE, _KV_EVENTS, _LOAD, s.STORE_ANNOUNCE]
    if m.role in WORKER_ROLES:
        deny = [
            s.REQUESTS,
            s.SCHEDULE,
            *_INTAKE,
            *_INTAKE_API,
            s.prefill_tasks("*"),
            _CTL,
            _KV_EVENTS,
            s.STORE_ANNOUNCE,
        ]
        if m.role == Role.DECODE and not d.switchable:
            deny.append(s.decode_tasks("*"))
        for other in d.instances():
            if other != m.instance:
                deny += [s.load_report("*", other), s.worker_stats("*", other)]
        return deny
    if m.role == "store":
        deny = [
            s.REQUESTS,
            s.SCHEDULE,
            s.INTAKE,
            *_INTAKE_API,
            *_TASKS,
            _CTL,
            _LOAD,
            f"{s.NS}.conductor.>",
        ]
        deny += [s.kv_events(n) for n in d.nodes() if n != m.node]
        return deny
    raise ValueError(f"unknown role {m.role!r}")


def subscribe_deny(m: Member) -> list[str]:
    if m.role in (*WORKER_ROLES, "store"):
        return [s.REQUESTS, s.SCHEDULE, s.INTAKE, s.SCHEDULE_QUEUE]
    return []


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
                tuple(publish_deny(m, d)),
                tuple(subscribe_deny(m)),
            )
        )
    return out


def _q(items) -> str:
    return "[" + ", ".join(json.dumps(i) for i in items) + "]"


def render(us: list[User], *, env_passwords: bool = False, env_users: bool = False) -> str:
    """An ``authorization`` block for nats-server. ``env_passwords``: each password is
    ``$<NAME>_NATS_PASSWORD`` (upper case, ``-`` as ``_``) from the server's environment,
    as compose passes them; ``env_users``: each user name ``$<NAME>_NATS_USER`` too (the
    Kubernetes Secret names them)."""
    lines = ["authorization {", "  users: ["]
    allow = [ALL, INBOX, *JETSTREAM]
    for u in us:
        pw = f"${env_var(u.name)}" if env_passwords else json.dumps(u.password)
        name = f"${env_var(u.name, 'USER')}" if env_users else json.dumps(u.name)
        if u.admin:
            lines.append(f"    {{user: {name}, password: {pw}}}")
            continue
        pub = f"{{allow: {_q(allow)}, deny: {_q(u.pub_deny)}}}"
        sub = f"{{allow: {_q(allow)}" + (f", deny: {_q(u.sub_deny)}}}" if u.sub_deny else "}")
        lines.append(f"    {{user: {name}, password: {pw},")
        lines.append(f"     permissions: {{publish: {pub},")
        lines.append(f"                   subscribe: {sub}}}}}")
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


def env_var(name: str, what: str = "PASSWORD") -> str:
    return name.upper().replace("-", "_") + "_NATS_" + what


def member(name: str, argv: list[str]) -> Member:
    """The member for a service's command line (``services.<role> ... --instance X``)."""
    role = argv[0].removeprefix("services.")

    def flag(f: str) -> str:
        return argv[argv.index(f) + 1] if f in argv else ""

    if role in WORKER_ROLES:
        return Member(name, role, instance=flag("--instance"))
    if role == "store":
        return Member(name, role, node=flag("--node"))
    return Member(name, role)


# The services of compose.yaml (one node of each serving role).
COMPOSE = Deployment(
    [
        Member("gateway", "gateway"),
        Member("admission", "admission"),
        Member("conductor", "conductor"),
        Member("prefill-0", Role.PREFILL, instance="prefill-0"),
        Member("decode-0", Role.DECODE, instance="decode-0"),
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


# Kubernetes (deploy/k8s): one user per role, since pods come and go with scaling (no
# per-instance rules); prefill and decode pods share "worker", as a RoleSwitch turns
# one into the other in place.
K8S = Deployment(
    [
        Member("gateway", "gateway"),
        Member("admission", "admission"),
        Member("conductor", "conductor"),
        Member("worker", Role.DECODE),
        Member("store", "store"),
    ],
    switchable=True,
)


def k8s_authorization() -> str:
    """deploy/k8s/base/nats.conf's authorization block (tests/unit/perigee/test_k8s_manifests.py
    holds them equal): names and passwords from the Secret, through each server's env."""
    return render(
        users(K8S, {u: "-" for u in [ADMIN, *(m.name for m in K8S.members)]}),
        env_passwords=True,
        env_users=True,
    )


if __name__ == "__main__":
    print(k8s_authorization() if sys.argv[1:] == ["k8s"] else compose_authorization(), end="")
