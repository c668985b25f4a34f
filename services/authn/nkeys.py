"""NATS NKEYs: Ed25519 keys written as base32 text with a type prefix and a CRC-16, the
form nats-server reads in its config (``issuer: A…``) and signs its requests with.

Written here on ``cryptography`` rather than taken from the ``nkeys`` package, which
pulls in PyNaCl for the same curve."""

import base64
import binascii
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

SEED = 18 << 3  # 'S'
ACCOUNT = 0  # 'A'
SERVER = 13 << 3  # 'N'
USER = 20 << 3  # 'U'
OPERATOR = 14 << 3  # 'O'
_PUBLIC = (ACCOUNT, SERVER, USER, OPERATOR)


class NKeyError(ValueError):
    """An NKEY of the wrong form, type or checksum."""

    pass


def _crc16(data: bytes) -> int:
    return binascii.crc_hqx(data, 0)  # CRC-16/XMODEM, as nkeys' table


def _b32(raw: bytes) -> str:
    return base64.b32encode(raw).decode().rstrip("=")


def _unb32(text: str) -> bytes:
    try:
        raw = base64.b32decode(text + "=" * (-len(text) % 8))
    except (binascii.Error, ValueError) as e:
        raise NKeyError("not base32") from e
    if len(raw) < 4 or _crc16(raw[:-2]) != int.from_bytes(raw[-2:], "little"):
        raise NKeyError("bad checksum")
    return raw[:-2]


def encode_public(prefix: int, key: bytes) -> str:
    raw = bytes([prefix]) + key
    return _b32(raw + _crc16(raw).to_bytes(2, "little"))


def decode_public(text: str, prefix: int | None = None) -> tuple[int, bytes]:
    """(prefix, 32-byte Ed25519 public key) of a public NKEY; ``prefix``: the one wanted."""
    raw = _unb32(text)
    if len(raw) != 33 or raw[0] not in _PUBLIC or (prefix is not None and raw[0] != prefix):
        raise NKeyError("not a public nkey of the wanted type")
    return raw[0], raw[1:]


@dataclass(frozen=True)
class KeyPair:
    """A signing key and its type (account, user, …)."""

    prefix: int
    private: Ed25519PrivateKey

    @classmethod
    def generate(cls, prefix: int = ACCOUNT) -> "KeyPair":
        return cls(prefix, Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: str) -> "KeyPair":
        raw = _unb32(seed.strip())
        if len(raw) != 34 or raw[0] & 0xF8 != SEED:
            raise NKeyError("not an nkey seed")
        prefix = ((raw[0] & 0x07) << 5) | ((raw[1] & 0xF8) >> 3)
        if prefix not in _PUBLIC:
            raise NKeyError("unknown nkey seed type")
        return cls(prefix, Ed25519PrivateKey.from_private_bytes(raw[2:]))

    @property
    def seed(self) -> str:
        raw_seed = self.private.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )
        raw = bytes([SEED | (self.prefix >> 5), (self.prefix & 31) << 3]) + raw_seed
        return _b32(raw + _crc16(raw).to_bytes(2, "little"))

    @property
    def public(self) -> str:
        key = self.private.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        return encode_public(self.prefix, key)

    def sign(self, data: bytes) -> bytes:
        return self.private.sign(data)


def verify(public: str, data: bytes, signature: bytes) -> bool:
    try:
        _, key = decode_public(public)
        Ed25519PublicKey.from_public_bytes(key).verify(signature, data)
    except (NKeyError, InvalidSignature, ValueError):
        return False
    return True
