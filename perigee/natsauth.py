"""Who may publish and subscribe what on the bus: one NATS user per service, each with an
allow-list of the subjects its role uses (derived from :mod:`bus_schemas.subjects`),
rendered as nats-server config. Nothing is allowed that is not listed; SECURITY.md ("Bus")
states the same lists in prose.

- A worker (prefill or decode instance) subscribes to its own tasks, pipeline stages,
  stats and the broadcast cancel (and the role switches when it is switchable; a
  prefill instance, the stores' answers to a round sent ahead,
  ``perigee.prefill.<instance>.reserved.*.*``); it
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
  rebuilds its prefix index from it), open a placement's first reservation round
  (``tx.allocate``, answered to the prefill instance) and settle transactions
  (``tx.commit/abort``).
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
  and each login may publish only its own; so do admission's and the conductors'
  presence beats, ``perigee.presence.<kind>.<name>``, which only the gateway reads.
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
from dataclasses import dataclass

from perigee import deploy_spec
from services.common.bus_permissions import (  # noqa: F401 - this module's public names
    ADMIN,
    AUTH_CALLOUT,
    INTAKE_STREAM,
    KV_STREAM,
    PLACED_STREAM,
    REPLIES,
    ROLES,
    SCHEDULE_STREAM,
    WORKER_ROLES,
    Deployment,
    Member,
    deliveries,
    inbox,
    publish_allow,
    subscribe_allow,
)


@dataclass(frozen=True)
class User:
    """One NATS login: its password and the subjects it may publish and subscribe to."""

    name: str
    password: str
    publish: tuple[str, ...] = ()
    subscribe: tuple[str, ...] = ()
    admin: bool = False


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


# The services of compose.yaml (one node of each serving role), as perigee.deploy_spec
# renders them there.
COMPOSE = Deployment([member(n, s.manifest_argv()) for n, s in deploy_spec.compose().items()])


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
