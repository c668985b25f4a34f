"""A Kubernetes projected ServiceAccount token, checked offline against the cluster's
signing keys (its JWKS, ``/openid/v1/jwks``): signature, issuer, audience, lifetime, and
the pod it is bound to. Nothing in it is believed before the signature checks."""

import base64
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

LEEWAY_S = 30  # clock skew between the API server and this pod
_MAX_TOKEN = 16 * 1024


class TokenError(ValueError):
    """A ServiceAccount token that is malformed or fails a check."""

    pass


@dataclass(frozen=True)
class PodIdentity:
    """Who a verified token speaks for."""

    namespace: str
    pod: str
    service_account: str
    expires: float


def _unb64(text: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (ValueError, TypeError) as e:
        raise TokenError("not base64url") from e


def _int(text: str) -> int:
    return int.from_bytes(_unb64(text), "big")


def _public_key(jwk: dict[str, Any]) -> Any:
    if jwk.get("kty") == "RSA":
        return rsa.RSAPublicNumbers(_int(jwk["e"]), _int(jwk["n"])).public_key()
    if jwk.get("kty") == "EC" and jwk.get("crv") == "P-256":
        return ec.EllipticCurvePublicNumbers(
            _int(jwk["x"]), _int(jwk["y"]), ec.SECP256R1()
        ).public_key()
    return None


class Verifier:
    """Checks tokens against a JWKS; ``keys`` is read again through ``refresh`` when a
    token names a key id it does not know (the cluster rotated its keys)."""

    def __init__(
        self,
        jwks: dict[str, Any],
        *,
        issuer: str,
        audience: str,
        clock: Callable[[], float],
        refresh: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.issuer, self.audience, self.clock, self._refresh = issuer, audience, clock, refresh
        self._keys: dict[str, Any] = {}
        self._load(jwks)

    def _load(self, jwks: dict[str, Any]) -> None:
        keys = {}
        for jwk in jwks.get("keys", []) if isinstance(jwks, dict) else []:
            if isinstance(jwk, dict) and (key := _public_key(jwk)) is not None:
                keys[str(jwk.get("kid", ""))] = key
        self._keys = keys

    def _key(self, kid: str) -> Any:
        if kid not in self._keys and self._refresh is not None:
            self._load(self._refresh())
        if kid not in self._keys:
            raise TokenError("unknown signing key")
        return self._keys[kid]

    def verify(self, token: str) -> PodIdentity:
        if not token or len(token) > _MAX_TOKEN:
            raise TokenError("no token")
        parts = token.split(".")
        if len(parts) != 3:
            raise TokenError("not a JWT")
        try:
            header = json.loads(_unb64(parts[0]))
        except ValueError as e:
            raise TokenError("unreadable header") from e
        if not isinstance(header, dict):
            raise TokenError("unreadable header")
        key = self._key(str(header.get("kid", "")))
        signed, sig = f"{parts[0]}.{parts[1]}".encode(), _unb64(parts[2])
        alg = header.get("alg")
        try:
            if alg == "RS256" and isinstance(key, rsa.RSAPublicKey):
                key.verify(sig, signed, padding.PKCS1v15(), hashes.SHA256())
            elif alg == "ES256" and isinstance(key, ec.EllipticCurvePublicKey) and len(sig) == 64:
                der = encode_dss_signature(int.from_bytes(sig[:32]), int.from_bytes(sig[32:]))
                key.verify(der, signed, ec.ECDSA(hashes.SHA256()))
            else:
                raise TokenError(f"algorithm {alg!r} not accepted for this key")
        except InvalidSignature as e:
            raise TokenError("bad signature") from e
        try:
            claims = json.loads(_unb64(parts[1]))
        except ValueError as e:
            raise TokenError("unreadable claims") from e
        return self._identity(claims)

    def _identity(self, claims: Any) -> PodIdentity:
        if not isinstance(claims, dict) or claims.get("iss") != self.issuer:
            raise TokenError("wrong issuer")
        aud = claims.get("aud")
        if self.audience not in (aud if isinstance(aud, list) else [aud]):
            raise TokenError("wrong audience")
        now = self.clock()
        exp, nbf = claims.get("exp"), claims.get("nbf", 0)
        if not isinstance(exp, (int, float)) or now > exp + LEEWAY_S:
            raise TokenError("expired")
        if isinstance(nbf, (int, float)) and now + LEEWAY_S < nbf:
            raise TokenError("not yet valid")
        k8s = claims.get("kubernetes.io")
        if not isinstance(k8s, dict):
            raise TokenError("not a pod-bound token")
        pod, sa = k8s.get("pod"), k8s.get("serviceaccount")
        if not (isinstance(pod, dict) and isinstance(sa, dict) and pod.get("name")):
            raise TokenError("not a pod-bound token")
        return PodIdentity(
            str(k8s.get("namespace", "")), str(pod["name"]), str(sa.get("name", "")), float(exp)
        )
