"""Per-pod bus identity as Kubernetes runs it (issue 22): a real nats-server with the
authorization block deploy/k8s/base/nats.conf carries (perigee.natsauth.K8S, the auth
callout on), the real auth callout process (python -m services.authn) checking
ServiceAccount tokens against a JWKS file, and pods logging in with tokens signed the
way the API server signs projected tokens (RS256, bound to a pod, audience
perigee-nats). The cluster's signing key is this test's own.

A pod acts as its own worker and store and as nothing else: not another pod's tasks,
load reports or KV events, not a client's stream; a token proves one pod, and every
forged, stale or misdirected one is refused while the honest logins beside it go on."""

import asyncio
import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import nats
import nats.errors
import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from bus_schemas import subjects
from perigee import natsauth
from perigee.natsd import NatsServer
from services.authn import nkeys
from services.common import bus

ROOT = Path(__file__).resolve().parents[2]
ISSUER = "https://kubernetes.default.svc.cluster.local"
NS = "perigee"
CONNECT = {"allow_reconnect": False, "max_reconnect_attempts": 0, "connect_timeout": 10}


def _b64(b: bytes) -> str:
    return base64.urlsafe_b64encode(b).decode().rstrip("=")


class Cluster:
    """The API server's part: a signing key, its JWKS, and tokens it mints."""

    def __init__(self, kid: str = "k1") -> None:
        self.kid = kid
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)

    def jwks(self) -> dict:
        n = self.key.public_key().public_numbers()
        return {
            "keys": [
                {
                    "kty": "RSA",
                    "kid": self.kid,
                    "alg": "RS256",
                    "use": "sig",
                    "n": _b64(n.n.to_bytes(256, "big")),
                    "e": _b64(n.e.to_bytes(3, "big")),
                }
            ]
        }

    def token(
        self,
        pod: str,
        *,
        ns: str = NS,
        sa: str = "perigee-worker",
        aud: str = "perigee-nats",
        iss: str = ISSUER,
        exp: float | None = None,
    ) -> str:
        now = time.time()
        head = _b64(json.dumps({"alg": "RS256", "kid": self.kid}).encode())
        claims = {
            "iss": iss,
            "aud": [aud],
            "iat": int(now),
            "nbf": int(now),
            "exp": int(exp if exp is not None else now + 3600),
            "sub": f"system:serviceaccount:{ns}:{sa}",
            "kubernetes.io": {
                "namespace": ns,
                "pod": {"name": pod, "uid": "uid-" + pod},
                "serviceaccount": {"name": sa, "uid": "uid-sa"},
            },
        }
        body = _b64(json.dumps(claims).encode())
        sig = self.key.sign(f"{head}.{body}".encode(), padding.PKCS1v15(), hashes.SHA256())
        return f"{head}.{body}.{_b64(sig)}"


@pytest.fixture(scope="module")
def k8s(tmp_path_factory):
    """nats-server + the auth callout, as deploy/k8s wires them."""
    d = tmp_path_factory.mktemp("authn")
    cluster = Cluster()
    (d / "jwks.json").write_text(json.dumps(cluster.jwks()))
    issuer = nkeys.KeyPair.generate(nkeys.ACCOUNT)
    passwords = {
        u: natsauth.new_password()
        for u in ("perigee", "gateway", "admission", "conductor", "authn")
    }
    auth = natsauth.render(natsauth.users(natsauth.K8S, passwords), callout_issuer=issuer.public)
    server = NatsServer(auth=auth, log_file=str(d / "nats.log")).start()
    log = open(d / "authn.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.authn",
            *("--nats", server.url, "--jwks-file", str(d / "jwks.json")),
            *("--token-issuer", ISSUER, "--namespace", NS),
        ],
        cwd=ROOT,
        env={
            **os.environ,
            "NATS_USER": "authn",
            "NATS_PASSWORD": passwords["authn"],
            "PERIGEE_AUTHN_SEED": issuer.seed,
            "PERIGEE_AUTHN_ISSUER": issuer.public,
            "PYTHONUNBUFFERED": "1",
        },
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while b"authn_ready" not in (d / "authn.log").read_bytes():
        assert proc.poll() is None, (d / "authn.log").read_text()
        assert time.monotonic() < deadline, "the auth callout did not start"
        time.sleep(0.05)  # a process's start-up, not synchronisation between tests
    admin = f"nats://perigee:{passwords['perigee']}@127.0.0.1:{server.port}"
    try:
        yield {
            "url": server.url,
            "admin": admin,
            "cluster": cluster,
            "log": d / "authn.log",
            "proc": proc,
        }
    finally:
        proc.terminate()
        assert proc.wait(timeout=20) == 0, (d / "authn.log").read_text()[-3000:]
        log.close()
        server.stop()


class Pod:
    """One login, with the server's permission errors it receives."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.nc: nats.NATS | None = None

    async def connect(self, url: str, user: str, token: str) -> "Pod":
        async def on_error(e: Exception) -> None:
            self.errors.append(str(e))

        self.nc = await nats.connect(
            url,
            user=user,
            password=token,
            error_cb=on_error,
            inbox_prefix=bus.inbox_prefix(user),
            **CONNECT,
        )
        return self

    async def violation(self, subject: str, op: str) -> bool:
        """Whether the server refuses this publish/subscribe. The error comes on its
        own, not ordered with a flush's PONG: waited for, bounded."""
        want = f'permissions violation for {op} to "{subject}"'.lower()
        if op == "publish":
            await self.nc.publish(subject, b"{}")
        else:
            await self.nc.subscribe(subject)
        await self.nc.flush()
        for _ in range(200):
            if any(want in e.lower() for e in self.errors):
                return True
            await asyncio.sleep(0.025)
        return False


async def _refused(k8s, user: str, token: str) -> str:
    with pytest.raises(nats.errors.Error) as e:
        await nats.connect(k8s["url"], user=user, password=token, **CONNECT)
    return str(e.value)


async def _delivered(admin, sender: Pod, subject: str) -> bool:
    """Whether ``sender``'s publish on ``subject`` reaches a subscriber (the admin)."""
    sub = await admin.subscribe(subject)
    await bus.sync(admin)
    await sender.nc.publish(subject, b"{}")
    await sender.nc.flush()
    # Sent after the pod's publish on another connection: once the marker arrives the
    # server has routed the pod's message, if it let it through.
    marker = await admin.subscribe(subject + "-marker")
    await bus.sync(admin)
    await sender.nc.flush()
    await admin.publish(subject + "-marker", b"")
    await admin.flush()
    got = False
    try:
        await marker.next_msg(timeout=10)
        while True:
            await sub.next_msg(timeout=0.2)
            got = True
    except nats.errors.TimeoutError:
        pass
    await sub.unsubscribe()
    await marker.unsubscribe()
    return got


async def test_a_pod_acts_as_its_own_worker_and_store_only(k8s):
    c = k8s["cluster"]
    admin = await nats.connect(k8s["admin"])
    a = await Pod().connect(k8s["url"], "worker-perigee-prefill-0", c.token("perigee-prefill-0"))
    s = await Pod().connect(k8s["url"], "store-perigee-prefill-0", c.token("perigee-prefill-0"))
    try:
        # Its own subjects: its tasks, its load report, its node's KV events.
        assert not await a.violation(subjects.prefill_tasks("perigee-prefill-0"), "subscription")
        assert await _delivered(admin, a, subjects.load_report("prefill", "perigee-prefill-0"))
        assert await _delivered(admin, s, subjects.kv_events("perigee-prefill-0"))
        # Another pod's: refused by the server, whatever the payload would claim.
        assert await a.violation(subjects.prefill_tasks("perigee-prefill-1"), "subscription")
        assert await a.violation(subjects.decode_tasks("perigee-decode-0"), "subscription")
        assert await a.violation("perigee.gw.>", "subscription")  # every client's stream
        assert await a.violation("_INBOX.worker-perigee-prefill-1.>", "subscription")
        assert not await _delivered(admin, a, subjects.load_report("decode", "perigee-decode-0"))
        assert not await _delivered(admin, s, subjects.kv_events("perigee-decode-0"))
        assert not await _delivered(admin, s, subjects.store_announce("perigee-decode-0"))
        assert await s.violation(subjects.store_ctl("perigee-decode-0", "clear"), "subscription")
    finally:
        for p in (a, s):
            await p.nc.close()
        await admin.close()


@pytest.mark.parametrize(
    "case",
    [
        "other_pod",
        "audience",
        "expired",
        "namespace",
        "service_account",
        "issuer",
        "forged",
        "garbage",
        "unknown_login",
        "control_plane_name",
    ],
)
async def test_every_false_claim_is_refused_and_honest_logins_go_on(k8s, case):
    c = k8s["cluster"]
    pod = "perigee-decode-0"
    user, token = {
        "other_pod": ("worker-" + pod, c.token("perigee-decode-1")),
        "audience": ("worker-" + pod, c.token(pod, aud="kubernetes")),
        "expired": ("worker-" + pod, c.token(pod, exp=time.time() - 3600)),
        "namespace": ("worker-" + pod, c.token(pod, ns="default")),
        "service_account": ("worker-" + pod, c.token(pod, sa="default")),
        "issuer": ("worker-" + pod, c.token(pod, iss="https://evil.example")),
        "forged": ("worker-" + pod, Cluster().token(pod)),  # same key id, another key
        "garbage": ("worker-" + pod, "x" * 500),
        "unknown_login": ("admin-" + pod, c.token(pod)),
        "control_plane_name": ("gateway", c.token(pod)),  # a static login: its password
    }[case]
    err = await _refused(k8s, user, token)
    assert "authorization" in err.lower(), err
    # The callout is still serving: the honest pod logs in right after, and speaks.
    admin = await nats.connect(k8s["admin"])
    ok = await Pod().connect(k8s["url"], "worker-" + pod, c.token(pod))
    try:
        assert await _delivered(admin, ok, subjects.load_report("decode", pod))
    finally:
        await ok.nc.close()
        await admin.close()
    assert k8s["proc"].poll() is None


async def test_the_token_file_is_read_again_at_each_connect(k8s, tmp_path, monkeypatch):
    """A projected token rotates in place: bus.connect reads NATS_PASSWORD_FILE at every
    (re)connect, so a login made after the kubelet rewrote it presents the new one."""
    c = k8s["cluster"]
    path = tmp_path / "nats-token"
    path.write_text(c.token("perigee-decode-0"))
    monkeypatch.setenv("NATS_USER", "worker-perigee-decode-0")
    monkeypatch.delenv("NATS_PASSWORD", raising=False)
    monkeypatch.setenv("NATS_PASSWORD_FILE", str(path))
    nc = await bus.connect(k8s["url"], name="decode-0", kind="worker", sender="perigee-decode-0")
    try:
        assert nc.is_connected
        # What a reconnect sends is the file's content then, not what it was at start:
        # another pod's token now, which the callout refuses.
        path.write_text(c.token("perigee-decode-1"))
        read = nc.options["password"]
        assert read() == path.read_text()
        with pytest.raises(nats.errors.Error):
            await nats.connect(k8s["url"], user="worker-perigee-decode-0", password=read, **CONNECT)
    finally:
        await nc.close()
