"""Who may speak on the store's data plane: the run's data key, message MACs, random ids.

Every store and worker of one run shares a secret, the *data key*, from the environment
(``PERIGEE_DATA_KEY``; ``perigee up`` draws one per run, as it draws the NATS
passwords; compose and Kubernetes take it from the run's credentials). It proves two
things a stranger on the network cannot:

- a ZeroMQ message (store <-> store OPEN / CLOSE, worker -> store SHIP / PULL / LEASE
  and every reply) carries a third frame, ``ts (u64 ns) || HMAC-SHA256(key, kind ||
  ts || header)``; a message without a valid one, older than ``WINDOW_S`` or seen before
  is dropped without a reply (:class:`Macs`);
- a TCP transfer stream opens with a HELLO that carries the sender's session id and
  the same kind of MAC (:func:`hello` / :func:`check_hello`), each accepted once;
- a connection to the object server opens with an object HELLO (:func:`obj_hello` /
  :func:`check_obj_hello`): a random session id and a MAC bound to the server's own
  address, each accepted once (the server's :class:`Macs` remembers it for the window).

Why an HMAC per message and not ZeroMQ CURVE: CURVE needs a key pair per store and
each peer's public key before it connects (a directory the node registry would have
to carry), and it encrypts every frame, which these small coordination headers do not
need (no KV byte rides ZeroMQ). One shared key per run, handed out like the NATS
passwords, authenticates every message for ~1 us, and the same key guards the TCP
streams, which CURVE would not cover. Confidentiality between hosts is TLS's job (see
SECURITY.md).

A key still containing a template's ``REPLACE-ME`` stops the process
(:mod:`services.common.placeholders`): stores read the key at start, workers too.

Without ``PERIGEE_DATA_KEY`` a process draws a key of its own and says so: it then
talks to no other process's store (a worker on the same host still reaches its store
through the Unix socket, which the file system guards).
"""

import hashlib
import hmac
import os
import secrets
import struct
import time
from collections import OrderedDict
from collections.abc import Sequence

import structlog

from services.common.placeholders import refuse_placeholder

log = structlog.get_logger()

ENV = "PERIGEE_DATA_KEY"
MIN_KEY_CHARS = 16
WINDOW_S = 60.0  # a MAC'd message older (or newer) than this is refused: clock skew bound
REPLAY_CACHE = 1 << 16  # MACs remembered to refuse a replay within the window
_TS = struct.Struct("<Q")
MAC_BYTES = _TS.size + 32

HELLO_MAGIC = b"PRGT2\n"
SESSION_BYTES = 16
HELLO_BYTES = len(HELLO_MAGIC) + SESSION_BYTES + MAC_BYTES

OBJ_HELLO_MAGIC = b"PRGO1\n"
OBJ_HELLO_BYTES = len(OBJ_HELLO_MAGIC) + SESSION_BYTES + MAC_BYTES

_key: bytes | None = None


class DataKeyError(ValueError):
    """The data key in the environment is unusable (too short)."""


def data_key() -> bytes:
    """This process's data key (``PERIGEE_DATA_KEY``, else one drawn for this process)."""
    global _key
    if _key is None:
        raw = os.environ.get(ENV, "")
        if raw:
            refuse_placeholder(f"the data key {ENV}", raw)
            if len(raw) < MIN_KEY_CHARS:
                raise DataKeyError(f"{ENV} must have at least {MIN_KEY_CHARS} characters")
            _key = raw.encode()
        else:
            _key = secrets.token_bytes(32)
            log.warning(
                "data_key_missing",
                detail=f"{ENV} is not set: this process talks to no other store "
                "(perigee up sets it per run)",
            )
    return _key


def new_key() -> str:
    """A fresh data key (for ``PERIGEE_DATA_KEY``)."""
    return secrets.token_urlsafe(32)


def new_id() -> int:
    """A request id nobody can guess (ids pair replies with requests)."""
    return secrets.randbits(62)


def _mac(key: bytes, ts: bytes, parts: Sequence[bytes | memoryview]) -> bytes:
    h = hmac.new(key, ts, hashlib.sha256)
    for p in parts:
        h.update(p)
    return h.digest()


class Macs:
    """Signs and checks the MAC frame of ZeroMQ messages under one key, refusing replays
    (a MAC seen within the window) and stale or future timestamps."""

    def __init__(
        self, key: bytes, window_s: float = WINDOW_S, clock=time.time_ns, cache: int = REPLAY_CACHE
    ) -> None:
        self.key = key
        self.window_ns = int(window_s * 1e9)
        self.clock = clock
        self.cache = cache
        self._seen: OrderedDict[bytes, int] = OrderedDict()

    def sign(self, parts: Sequence[bytes]) -> bytes:
        ts = _TS.pack(self.clock())
        return ts + _mac(self.key, ts, parts)

    def check(self, parts: Sequence[bytes | memoryview], mac: bytes | memoryview) -> bool:
        if len(mac) != MAC_BYTES:
            return False
        ts = bytes(mac[: _TS.size])
        tag = bytes(mac[_TS.size :])
        if not hmac.compare_digest(tag, _mac(self.key, ts, parts)):
            return False
        (sent,) = _TS.unpack(ts)
        now = self.clock()
        if abs(now - sent) > self.window_ns:
            return False
        while self._seen:  # forget what the window no longer admits
            first_ts = next(iter(self._seen.values()))
            if now - first_ts <= self.window_ns and len(self._seen) < self.cache:
                break
            self._seen.popitem(last=False)
        if tag in self._seen:
            return False
        self._seen[tag] = sent
        return True


def hello(key: bytes, session: bytes) -> bytes:
    """The first bytes of a TCP transfer stream: magic, session id, MAC."""
    ts = _TS.pack(time.time_ns())
    return HELLO_MAGIC + session + ts + _mac(key, ts, (HELLO_MAGIC, session))


def check_hello(macs: "Macs | None", raw: bytes) -> bytes | None:
    """The session id of a HELLO, or None when it is not one (or, with ``macs``, not MAC'd
    with its key, out of the window, or seen before: ``macs`` remembers it, so a HELLO
    captured on the wire opens no second stream)."""
    if len(raw) != HELLO_BYTES or not raw.startswith(HELLO_MAGIC):
        return None
    session = raw[len(HELLO_MAGIC) : len(HELLO_MAGIC) + SESSION_BYTES]
    if macs is None:
        return session
    mac = raw[len(HELLO_MAGIC) + SESSION_BYTES :]
    return session if macs.check((HELLO_MAGIC, session), mac) else None


def obj_hello(key: bytes, addr: str) -> bytes:
    """The first bytes of a connection to the object server at ``addr`` (its
    ``StoreInfo.obj_addr``): magic, a random session id, a MAC over both and ``addr`` (so
    a HELLO seen on the way to one store opens no other)."""
    session = secrets.token_bytes(SESSION_BYTES)
    return OBJ_HELLO_MAGIC + session + Macs(key).sign((OBJ_HELLO_MAGIC, session, addr.encode()))


def check_obj_hello(macs: Macs, addr: str, raw: bytes | memoryview) -> bool:
    """Whether ``raw`` is an object HELLO for ``addr`` under ``macs``' key, in the window
    and not seen before (``macs`` remembers it: a replayed HELLO opens nothing)."""
    if len(raw) != OBJ_HELLO_BYTES or bytes(raw[: len(OBJ_HELLO_MAGIC)]) != OBJ_HELLO_MAGIC:
        return False
    session = bytes(raw[len(OBJ_HELLO_MAGIC) : len(OBJ_HELLO_MAGIC) + SESSION_BYTES])
    mac = raw[len(OBJ_HELLO_MAGIC) + SESSION_BYTES :]
    return macs.check((OBJ_HELLO_MAGIC, session, addr.encode()), mac)
