"""python -m services.authn: the bus's login service on Kubernetes (a NATS auth callout).

Serving pods log in as ``worker-<pod>`` / ``store-<pod>`` with their projected
ServiceAccount token (audience ``--audience``) as the password. nats-server asks this
service about each such login (``$SYS.REQ.USER.AUTH``); it checks the token against the
cluster's signing keys and answers with that pod's own allow-lists (services.common.bus_permissions), so
one pod can neither read another's tasks nor speak in its name.

    python -m services.authn keygen    the issuer's seed and public key, for the Secret
"""

import argparse
import asyncio
import os
import sys
import time

from nats.aio.msg import Msg
from prometheus_client import Counter

from services.authn import callout, jwks, natsjwt, nkeys
from services.authn.k8s_token import Verifier
from services.common import bus, metrics, runner
from services.common.logging import configure
from services.common.placeholders import refuse_placeholder
from services.common.shutdown import StopEvent

AUTH_SUBJECT = "$SYS.REQ.USER.AUTH"
SEED_ENV, PUBLIC_ENV = "PERIGEE_AUTHN_SEED", "PERIGEE_AUTHN_ISSUER"
LOGINS = Counter(
    "perigee:authn_logins",
    "Serving pods' bus logins the auth callout decided, by outcome "
    "(granted, refused, or bad_request: not a server's signed request).",
    ["outcome"],
)


def _role_accounts(items: list[str]) -> dict[str, frozenset[str]]:
    out: dict[str, set[str]] = {}
    for item in items:
        role, _, account = item.partition("=")
        if role not in callout.ROLES or not account:
            raise SystemExit(
                f"--role-account {item!r}: want ROLE=SERVICEACCOUNT, ROLE one of {sorted(callout.ROLES)}"
            )
        out.setdefault(role, set()).add(account)
    return {r: frozenset(a) for r, a in out.items()}


def _namespace() -> str:
    try:
        with open(f"{jwks.SA_DIR}/namespace", encoding="utf-8") as f:
            return f.read().strip()
    except FileNotFoundError:
        return "perigee"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m services.authn",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--nats", default="nats://127.0.0.1:4222", help="NATS URL (login: NATS_USER/NATS_PASSWORD)"
    )
    ap.add_argument(
        "--jwks-url", default=jwks.IN_CLUSTER, help="the cluster's ServiceAccount signing keys"
    )
    ap.add_argument("--jwks-file", default="", help="read the signing keys from this file instead")
    ap.add_argument(
        "--token-issuer",
        default="https://kubernetes.default.svc.cluster.local",
        help="the tokens' iss (the API server's --service-account-issuer)",
    )
    ap.add_argument(
        "--audience",
        default="perigee-nats",
        help="the audience the pods' projected tokens are minted for",
    )
    ap.add_argument(
        "--namespace", default="", help="the serving pods' namespace (default: this pod's)"
    )
    ap.add_argument(
        "--role-account",
        action="append",
        default=[],
        metavar="ROLE=SERVICEACCOUNT",
        help="a ServiceAccount whose pods may log in as ROLE (worker, store); repeatable; default worker=perigee-worker, store=perigee-worker",
    )
    ap.add_argument("--log-level", default="INFO")
    metrics.add_arguments(ap)
    return ap.parse_args(argv)


def issuer_from_env() -> nkeys.KeyPair:
    seed = os.environ.get(SEED_ENV, "")
    refuse_placeholder("the auth callout's issuer seed", seed, SEED_ENV)
    if not seed:
        raise SystemExit(
            f"refusing to start: {SEED_ENV} is not set (python -m services.authn keygen)"
        )
    key = nkeys.KeyPair.from_seed(seed)
    public = os.environ.get(PUBLIC_ENV, "")
    if public and public != key.public:
        # nats-server trusts only answers signed by the key its config names.
        raise SystemExit(f"refusing to start: {PUBLIC_ENV} is not the public key of {SEED_ENV}")
    return key


async def amain(args: argparse.Namespace) -> int:
    log = configure("authn", args.log_level)
    issuer = issuer_from_env()
    read_keys = jwks.source(args.jwks_file, args.jwks_url, time.monotonic)
    verifier = Verifier(
        await asyncio.to_thread(read_keys),
        issuer=args.token_issuer,
        audience=args.audience,
        clock=time.time,
        refresh=read_keys,
    )
    policy = callout.Policy(
        args.namespace or _namespace(),
        _role_accounts(args.role_account or ["worker=perigee-worker", "store=perigee-worker"]),
    )
    stop = StopEvent()
    bus.install_signal_handlers(stop)
    nc = await bus.connect(args.nats, name="authn", kind="authn")

    async def on_request(msg: Msg) -> None:
        try:
            answer, user, reason = callout.respond(
                msg.data, issuer=issuer, verifier=verifier, policy=policy, clock=time.time
            )
        except natsjwt.JWTError as e:
            log.warning("authn_bad_request", error=str(e))  # not the server's: no answer
            LOGINS.labels("bad_request").inc()
            return
        if reason:
            log.warning("authn_refused", user=user, reason=reason)
        else:
            log.info("authn_granted", user=user)
        LOGINS.labels("refused" if reason else "granted").inc()
        await msg.respond(answer.encode())

    # One queue group: every copy of the service answers a share of the logins.
    await nc.subscribe(AUTH_SUBJECT, queue="perigee-authn", cb=on_request)
    await bus.sync(nc)
    mserver = await metrics.start_from_args(args, "authn", ready=lambda: nc.is_connected)
    log.info("authn_ready", issuer=issuer.public, namespace=policy.namespace)
    await stop.wait()
    if mserver is not None:
        await mserver.close()
    await bus.drain(nc)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["keygen"]:
        key = nkeys.KeyPair.generate(nkeys.ACCOUNT)
        print(f"authn-issuer-seed={key.seed}\nauthn-issuer-public={key.public}")
        return 0
    return runner.run(amain(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
