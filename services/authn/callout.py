"""The auth callout's decision, pure: a server's authorization request in, a signed
response out. A serving pod logs in as ``worker-<pod>`` or ``store-<pod>`` with its
projected ServiceAccount token as the password; it gets the allow-lists of
:mod:`services.common.bus_permissions` for its own instance and node (both the pod's name) and nothing
of any other pod's. Anything else is refused with a reason the server logs."""

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bus_schemas.roles import Role
from services.authn import natsjwt, nkeys
from services.authn.k8s_token import TokenError, Verifier
from services.common import bus_permissions as perms

# The login's role part -> its member role (workers switch roles in place).
ROLES = {"worker": Role.DECODE, "store": "store"}
_POD = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")  # a DNS label: one subject token
_PODS = perms.Deployment(switchable=True)  # as perigee.natsauth.K8S: RoleSwitch in place
ACCOUNT = "$G"  # the server's global account (no accounts in perigee's nats.conf)


class LoginRefused(Exception):
    """A login the callout refuses, with the reason the server logs."""

    pass


@dataclass(frozen=True)
class Policy:
    """Who may log in how: the pods' namespace and, per login role, the ServiceAccounts
    allowed to take it."""

    namespace: str
    accounts: dict[str, frozenset[str]] = field(default_factory=dict)


def permissions(user: str, pod: str) -> tuple[list[str], list[str]]:
    """(publish, subscribe) allow-lists of login ``user`` (``<role>-<pod>``)."""
    role = user.split("-", 1)[0]
    member = perms.Member(user, ROLES[role], instance=pod, node=pod)
    return perms.publish_allow(member, _PODS), perms.subscribe_allow(member, _PODS)


def decide(
    user: str, token: str, verifier: Verifier, policy: Policy
) -> tuple[list[str], list[str]]:
    role, _, pod = user.partition("-")
    if role not in ROLES or not _POD.fullmatch(pod):
        raise LoginRefused(
            f"unknown login {user[:80]!r}: serving pods log in as worker-<pod> or store-<pod>"
        )
    try:
        who = verifier.verify(token)
    except TokenError as e:
        raise LoginRefused(f"token refused: {e}") from e
    if who.namespace != policy.namespace:
        raise LoginRefused(f"token of namespace {who.namespace!r}")
    if who.service_account not in policy.accounts.get(role, frozenset()):
        raise LoginRefused(f"service account {who.service_account!r} may not log in as {role}")
    if who.pod != pod:
        raise LoginRefused(f"token of pod {who.pod!r} presented for {pod!r}")
    return permissions(user, pod)


def _dict(x: Any) -> dict[str, Any]:
    return x if isinstance(x, dict) else {}


def respond(
    request: bytes,
    *,
    issuer: nkeys.KeyPair,
    verifier: Verifier,
    policy: Policy,
    clock: Callable[[], float],
) -> tuple[str, str, str]:
    """(response JWT, login, refusal reason or "") for one ``$SYS.REQ.USER.AUTH``
    request. A request that is not a server's signed one raises ``natsjwt.JWTError``:
    it gets no answer."""
    claims = natsjwt.decode(request.decode(errors="replace"), issuer_prefix=nkeys.SERVER)
    req: Any = claims.get("nats")
    if not isinstance(req, dict) or req.get("type") != "authorization_request":
        raise natsjwt.JWTError("not an authorization request")
    user_nkey = str(req.get("user_nkey", ""))
    server: dict[str, Any] = _dict(req.get("server_id"))
    opts: dict[str, Any] = _dict(req.get("connect_opts"))
    user, token = str(opts.get("user") or ""), str(opts.get("pass") or "")
    now = int(clock())
    body: dict[str, Any] = {"type": "authorization_response", "version": 2}
    reason = ""
    try:
        pub, sub = decide(user, token, verifier, policy)
        body["jwt"] = natsjwt.encode(
            {
                "sub": user_nkey,
                "aud": ACCOUNT,
                "name": user,
                "iat": now,
                "nats": {
                    "pub": {"allow": pub},
                    "sub": {"allow": sub},
                    # allow_responses: one reply to each request received, within a minute
                    "resp": {"max": 1, "ttl": 60_000_000_000},
                    "subs": -1,
                    "data": -1,
                    "payload": -1,
                    "type": "user",
                    "version": 2,
                },
            },
            issuer,
        )
    except LoginRefused as e:
        reason = str(e)
        body["error"] = reason
    response = natsjwt.encode(
        {"sub": user_nkey, "aud": str(server.get("id", "")), "iat": now, "nats": body}, issuer
    )
    return response, user, reason
