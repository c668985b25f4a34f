"""NATS JWTs (``alg: ed25519-nkey``): decode the server's authorization request, sign
the user and the response the callout answers with (ADR-26)."""

import base64
import hashlib
import json
from typing import Any

from services.authn import nkeys

HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}


class JWTError(ValueError):
    """A NATS JWT that does not decode or verify."""

    pass


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (ValueError, TypeError) as e:
        raise JWTError("not base64url") from e


def encode(claims: dict[str, Any], key: nkeys.KeyPair) -> str:
    """``claims`` signed by ``key``, which becomes their ``iss``; ``jti`` is the claims'
    hash, as nats' jwt package computes it."""
    body = {**claims, "iss": key.public, "jti": ""}
    body["jti"] = (
        base64.b32encode(hashlib.sha256(json.dumps(body).encode()).digest()).decode().rstrip("=")
    )
    head = _b64(json.dumps(HEADER).encode())
    payload = _b64(json.dumps(body, separators=(",", ":")).encode())
    signature = key.sign(f"{head}.{payload}".encode())
    return f"{head}.{payload}.{_b64(signature)}"


def decode(token: str, *, issuer_prefix: int | None = None) -> dict[str, Any]:
    """The claims of a NATS JWT whose signature verifies under its own ``iss`` (of type
    ``issuer_prefix`` where given)."""
    parts = token.strip().split(".")
    if len(parts) != 3:
        raise JWTError("not a JWT")
    try:
        header = json.loads(_unb64(parts[0]))
        claims = json.loads(_unb64(parts[1]))
    except (ValueError, UnicodeDecodeError) as e:
        raise JWTError("unreadable JWT") from e
    if not isinstance(header, dict) or header.get("alg") != HEADER["alg"]:
        raise JWTError("not an ed25519-nkey JWT")
    if not isinstance(claims, dict) or not isinstance(claims.get("iss"), str):
        raise JWTError("no issuer")
    try:
        nkeys.decode_public(claims["iss"], issuer_prefix)
    except nkeys.NKeyError as e:
        raise JWTError(f"issuer: {e}") from e
    if not nkeys.verify(claims["iss"], f"{parts[0]}.{parts[1]}".encode(), _unb64(parts[2])):
        raise JWTError("bad signature")
    return claims
