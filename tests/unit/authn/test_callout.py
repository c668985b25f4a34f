"""The auth callout's pure parts: NKEY text, NATS JWTs, the Kubernetes token check (an
injected clock) and the decision a server's request gets."""

import base64
import json

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

from bus_schemas import subjects
from services.authn import callout, jwks, natsjwt, nkeys
from services.authn.k8s_token import LEEWAY_S, TokenError, Verifier

ISS, AUD, NOW = "https://k8s.test", "perigee-nats", 1_000_000.0


def b64(b: bytes) -> str:
    return base64.urlsafe_b64encode(b).decode().rstrip("=")


class Signer:
    def __init__(self, kid: str = "k1", kind: str = "RS256") -> None:
        self.kid, self.kind = kid, kind
        if kind == "RS256":
            self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        else:
            self.key = ec.generate_private_key(ec.SECP256R1())

    def jwk(self) -> dict:
        if self.kind == "RS256":
            n = self.key.public_key().public_numbers()
            return {
                "kty": "RSA",
                "kid": self.kid,
                "n": b64(n.n.to_bytes(256, "big")),
                "e": b64(n.e.to_bytes(3, "big")),
            }
        p = self.key.public_key().public_numbers()
        return {
            "kty": "EC",
            "crv": "P-256",
            "kid": self.kid,
            "x": b64(p.x.to_bytes(32, "big")),
            "y": b64(p.y.to_bytes(32, "big")),
        }

    def token(self, pod: str = "pod-a", **over) -> str:
        claims = {
            "iss": ISS,
            "aud": [AUD],
            "exp": NOW + 600,
            "nbf": NOW - 1,
            "kubernetes.io": {
                "namespace": "perigee",
                "pod": {"name": pod, "uid": "u"},
                "serviceaccount": {"name": "perigee-worker", "uid": "s"},
            },
        }
        claims.update(over)
        head = b64(json.dumps({"alg": self.kind, "kid": self.kid}).encode())
        body = b64(json.dumps(claims).encode())
        signed = f"{head}.{body}".encode()
        if self.kind == "RS256":
            sig = self.key.sign(signed, padding.PKCS1v15(), hashes.SHA256())
        else:
            r, s = decode_dss_signature(self.key.sign(signed, ec.ECDSA(hashes.SHA256())))
            sig = r.to_bytes(32, "big") + s.to_bytes(32, "big")
        return f"{head}.{body}.{b64(sig)}"


@pytest.fixture(scope="module")
def signer() -> Signer:
    return Signer()


def verifier(signer: Signer, now: float = NOW, refresh=None) -> Verifier:
    return Verifier(
        {"keys": [signer.jwk()]}, issuer=ISS, audience=AUD, clock=lambda: now, refresh=refresh
    )


def test_nkeys_round_trip_and_reject_a_changed_character():
    kp = nkeys.KeyPair.generate(nkeys.ACCOUNT)
    assert kp.public.startswith("A") and kp.seed.startswith("SA")
    assert nkeys.KeyPair.from_seed(kp.seed).public == kp.public
    assert nkeys.verify(kp.public, b"x", kp.sign(b"x"))
    assert not nkeys.verify(kp.public, b"y", kp.sign(b"x"))
    flipped = kp.public[:10] + ("B" if kp.public[10] != "B" else "C") + kp.public[11:]
    with pytest.raises(nkeys.NKeyError):
        nkeys.decode_public(flipped)
    with pytest.raises(nkeys.NKeyError):
        nkeys.decode_public(kp.public, nkeys.SERVER)  # an account key is not a server's


def test_a_jwt_verifies_under_its_issuer_only():
    kp = nkeys.KeyPair.generate(nkeys.SERVER)
    token = natsjwt.encode({"sub": "x"}, kp)
    assert natsjwt.decode(token, issuer_prefix=nkeys.SERVER)["sub"] == "x"
    head, body, sig = token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(body + "=="))
    claims["sub"] = "y"
    tampered = f"{head}.{b64(json.dumps(claims).encode())}.{sig}"
    with pytest.raises(natsjwt.JWTError):
        natsjwt.decode(tampered)
    with pytest.raises(natsjwt.JWTError):
        natsjwt.decode(token, issuer_prefix=nkeys.ACCOUNT)


@pytest.mark.parametrize("kind", ["RS256", "ES256"])
def test_a_pod_token_names_its_pod(kind):
    s = Signer(kind=kind)
    who = verifier(s).verify(s.token("perigee-decode-3"))
    assert (who.namespace, who.pod, who.service_account) == (
        "perigee",
        "perigee-decode-3",
        "perigee-worker",
    )


@pytest.mark.parametrize(
    "over, why",
    [
        ({"iss": "https://other"}, "issuer"),
        ({"aud": ["kubernetes"]}, "audience"),
        ({"exp": NOW - LEEWAY_S - 1}, "expired"),
        ({"nbf": NOW + LEEWAY_S + 1}, "not yet"),
        ({"kubernetes.io": {"namespace": "perigee"}}, "pod-bound"),
    ],
)
def test_a_token_is_refused_for_each_false_claim(signer, over, why):
    with pytest.raises(TokenError, match=why):
        verifier(signer).verify(signer.token(**over))


def test_leeway_is_the_only_slack(signer):
    assert verifier(signer, now=NOW + 600 + LEEWAY_S).verify(signer.token()).pod == "pod-a"
    with pytest.raises(TokenError, match="expired"):
        verifier(signer, now=NOW + 600 + LEEWAY_S + 1).verify(signer.token())


def test_a_token_signed_by_another_key_or_alg_is_refused(signer):
    other = Signer(kid=signer.kid)
    with pytest.raises(TokenError, match="signature"):
        verifier(signer).verify(other.token())
    head, body, sig = signer.token().split(".")
    none_alg = b64(json.dumps({"alg": "none", "kid": signer.kid}).encode())
    with pytest.raises(TokenError, match="algorithm"):
        verifier(signer).verify(f"{none_alg}.{body}.")


def test_an_unknown_key_id_reads_the_keys_again(signer):
    """The cluster rotated its keys: a token under the new key id makes the verifier read
    the keys again (jwks.source rate-limits those reads); an id still unknown is refused."""
    rotated = Signer(kid="k2")
    reads = []

    def refresh():
        reads.append(1)
        return {"keys": [signer.jwk(), rotated.jwk()]}

    v = verifier(signer, refresh=refresh)
    assert v.verify(signer.token()).pod == "pod-a" and reads == []
    assert v.verify(rotated.token("pod-b")).pod == "pod-b" and len(reads) == 1
    with pytest.raises(TokenError, match="unknown signing key"):
        v.verify(Signer(kid="k9").token())


def test_the_jwks_source_rate_limits_reads(tmp_path):
    path = tmp_path / "jwks.json"
    path.write_text(json.dumps({"keys": []}))
    now = [100.0]
    read = jwks.source(str(path), "", lambda: now[0])
    assert read() == {"keys": []}
    path.write_text(json.dumps({"keys": [{"kid": "new"}]}))
    now[0] += jwks.MIN_REFETCH_S - 1
    assert read() == {"keys": []}  # within the window: the last keys again
    now[0] += 1
    assert read() == {"keys": [{"kid": "new"}]}


POLICY = callout.Policy(
    "perigee", {"worker": frozenset({"perigee-worker"}), "store": frozenset({"perigee-worker"})}
)


def request(server: nkeys.KeyPair, user: str, token: str) -> bytes:
    return natsjwt.encode(
        {
            "sub": nkeys.KeyPair.generate(nkeys.ACCOUNT).public,
            "aud": "nats-authorization-request",
            "nats": {
                "type": "authorization_request",
                "version": 2,
                "server_id": {"name": "n1", "id": server.public},
                "user_nkey": "UCLIENTKEY",
                "connect_opts": {"user": user, "pass": token},
            },
        },
        server,
    ).encode()


def test_a_granted_login_gets_its_own_pods_subjects(signer):
    server, issuer = nkeys.KeyPair.generate(nkeys.SERVER), nkeys.KeyPair.generate(nkeys.ACCOUNT)
    answer, user, reason = callout.respond(
        request(server, "worker-pod-a", signer.token("pod-a")),
        issuer=issuer,
        verifier=verifier(signer),
        policy=POLICY,
        clock=lambda: NOW,
    )
    assert (user, reason) == ("worker-pod-a", "")
    resp = natsjwt.decode(answer, issuer_prefix=nkeys.ACCOUNT)
    assert (
        resp["iss"] == issuer.public
        and resp["sub"] == "UCLIENTKEY"
        and resp["aud"] == server.public
    )
    granted = natsjwt.decode(resp["nats"]["jwt"])
    assert granted["sub"] == "UCLIENTKEY" and granted["aud"] == callout.ACCOUNT
    sub = granted["nats"]["sub"]["allow"]
    assert subjects.prefill_tasks("pod-a") in sub and subjects.decode_tasks("pod-a") in sub
    assert "_INBOX.worker-pod-a.>" in sub
    assert not any("pod-b" in x or x.startswith("perigee.gw") for x in sub)
    assert subjects.load_report("decode", "pod-a") in granted["nats"]["pub"]["allow"]


@pytest.mark.parametrize(
    "user, pod, why",
    [
        ("worker-pod-b", "pod-a", "presented for"),
        ("gateway", "pod-a", "unknown login"),
        ("worker-a.b", "a.b", "unknown login"),  # a dot would reach into other subjects
        ("worker-*", "*", "unknown login"),
    ],
)
def test_a_refusal_says_why_and_grants_nothing(signer, user, pod, why):
    server, issuer = nkeys.KeyPair.generate(nkeys.SERVER), nkeys.KeyPair.generate(nkeys.ACCOUNT)
    answer, _, reason = callout.respond(
        request(server, user, signer.token(pod)),
        issuer=issuer,
        verifier=verifier(signer),
        policy=POLICY,
        clock=lambda: NOW,
    )
    assert why in reason
    resp = natsjwt.decode(answer)
    assert "jwt" not in resp["nats"] and why in resp["nats"]["error"]


def test_a_request_not_signed_by_a_server_gets_no_answer(signer):
    not_server = nkeys.KeyPair.generate(nkeys.ACCOUNT)
    with pytest.raises(natsjwt.JWTError):
        callout.respond(
            request(not_server, "worker-pod-a", signer.token()),
            issuer=nkeys.KeyPair.generate(),
            verifier=verifier(signer),
            policy=POLICY,
            clock=lambda: NOW,
        )


def test_the_service_refuses_a_placeholder_or_mismatched_issuer_key(monkeypatch):
    from services.authn.__main__ import PUBLIC_ENV, SEED_ENV, issuer_from_env
    from services.common.placeholders import PlaceholderSecret

    monkeypatch.setenv(SEED_ENV, "REPLACE-ME-authn-issuer-seed")
    with pytest.raises(PlaceholderSecret):
        issuer_from_env()
    key = nkeys.KeyPair.generate()
    monkeypatch.setenv(SEED_ENV, key.seed)
    monkeypatch.setenv(PUBLIC_ENV, nkeys.KeyPair.generate().public)  # another key's half
    with pytest.raises(SystemExit, match="not the public key"):
        issuer_from_env()
    monkeypatch.setenv(PUBLIC_ENV, key.public)
    assert issuer_from_env().public == key.public
