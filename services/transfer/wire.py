"""The store data plane's coordination frames: ``[kind byte][msgpack header]``.

No payload rides these frames (a message with more is refused, ``bad_frame``): they say which transaction, which slots, which epoch,
and done or failed; the bytes move through the transfer engine
(:mod:`services.transfer.batch_api`: shared memory on one host, multi-stream TCP
across hosts, RDMA where a device exists).

Worker -> its node's store (its Unix socket, see ``local_channel``; or DEALER -> ROUTER):
    SHIP  send span [offset, offset+length) of my slots ``src_slots`` into the same span
          of ``dst_slots`` on the store at ``dst_addr``. The ships into one destination
          transaction's slots share one write grant (a *lease*: one OPEN, one CLOSE);
          ``last`` ends it. Answered OK once the bytes are in live slots: over TCP the
          far receiver checked every write; over shared memory (or RDMA) the last
          ship's OK waits for the CLOSE verdict, which covers every ship of the lease,
          unless the far store shares its slot generations (GRANTED ``gens_shm``):
          then each shm ship reads them after its copy, and the CLOSE goes unawaited.
    LEASE open the lease for ships into ``dst_slots`` of ``dst_tx`` ahead of them (a
          prefill worker sends it when its transactions are reserved, so the OPEN
          round trip overlaps the compute); answered OK once granted.
    PULL  fetch whole slots ``src_slots`` from the store at ``src_addr`` into my
          ``dst_slots``; answered OK once written.
Store -> store:
    OPEN  "I am about to write (``write``) or read span [offset, offset+length) of
          ``slots`` of transaction ``tx`` of ``epoch``": checked against the pool and
          answered GRANTED (grant id, the store's transfer segments and region ids, how
          long the grant lives) or ERR.
    CLOSE "grant ``grant`` is done (``ok``) or failed": answered OK when every slot of
          the grant was still live throughout, else ERR ``fenced`` (the bytes are
          discarded: the transaction was aborted or expired meanwhile).
Replies: OK, GRANTED, ERR (stable ``code`` + message). The object API's headers
(OBJ_PUT / OBJ_GET, DATA, appended below) are the store's plain-TCP object endpoint's
(:mod:`services.store.node.object_server`), never the data plane's.

Every request carries an ``id`` echoed in its reply, so many requests share one
socket. Headers are msgpack maps (not arrays) so a malformed header still yields its
``id`` for the error reply when possible. Appending fields with defaults keeps old
peers compatible.
"""

from collections.abc import Sequence
from enum import IntEnum
from typing import Any

import msgspec

from services.transfer.data_auth import Macs


class Kind(IntEnum):
    """The kind byte of a data-plane frame: requests first, replies from 16."""

    SHIP = 1
    PULL = 2
    OPEN = 3
    CLOSE = 4
    OBJ_PUT = 5
    OBJ_GET = 6
    LEASE = 7
    OK = 16
    ERR = 17
    DATA = 18
    GRANTED = 19


class WireError(ValueError):
    """A frame that does not parse or does not fit; ``code`` is the stable reason."""

    def __init__(self, message: str, code: str = "bad_frame", req_id: int = -1) -> None:
        super().__init__(message)
        self.code = code
        self.req_id = req_id


class _Header(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    id: int


class Ship(_Header):
    """Worker to store: send a span of my slots into a transaction's slots on another store."""

    src_tx: str
    src_epoch: int
    src_slots: list[int]
    dst_addr: str
    dst_tx: str
    dst_epoch: int
    dst_slots: list[int]
    offset: int
    length: int
    layer: int = -1
    trace: dict[str, str] = {}  # W3C trace context (traceparent, tracestate)
    last: bool = True  # the last ship into these slots: it closes their lease
    # A request id: the worker's last read of src_tx, which the store then commits (the
    # prefill transaction, without the conductor's TxCommit); "": none.
    commit_src: str = ""


class Lease(_Header):
    """Worker to store: open the write grant for later ships into a transaction's slots."""

    dst_addr: str
    dst_tx: str
    dst_epoch: int
    dst_slots: list[int]
    trace: dict[str, str] = {}


class Pull(_Header):
    """Worker to store: fetch whole slots from another store into mine."""

    dst_tx: str
    dst_epoch: int
    dst_slots: list[int]
    src_addr: str
    src_tx: str
    src_epoch: int
    src_slots: list[int]
    trace: dict[str, str] = {}


class Open(_Header):
    """Store to store: ask for a grant to write or read a span of a transaction's slots."""

    tx: str
    epoch: int
    slots: list[int]
    offset: int
    length: int
    write: bool
    pid: int = 0  # ignored: nothing the wire says of a process is believed
    origin: str = ""  # the requester's shared-memory segment (tells a same-host requester)
    trace: dict[str, str] = {}


class Granted(_Header):
    """The answer to OPEN: the grant, where its bytes go, how long it lives."""

    grant: int
    segments: dict[str, str]  # transport (tcp, shm, rdma) -> this store's segment
    regions: dict[str, int]  # transport -> the arena's region id there
    ttl_s: float  # the grant is closed as failed after this long
    # A write grant's slot generations when it opened, and the shared-memory segment
    # where the store keeps them (int64 per slot): a same-host writer that finds them
    # unchanged after its copy knows the CLOSE verdict without asking ("" / []: ask).
    gens: list[int] = []
    gens_shm: str = ""
    # The grant's capability: every TCP transfer under it and its CLOSE present it.
    token: bytes = b""


class Close(_Header):
    """Store to store: a grant is done or failed."""

    grant: int
    ok: bool
    nbytes: int = 0
    token: bytes = b""  # the grant's (GRANTED ``token``): a CLOSE without it is refused
    quiet: bool = False  # no reply: the sender does not wait for the verdict
    # The request's trace: the peer's store.close joins it (without, each CLOSE was a
    # trace of its own, sampled at the peer's root).
    trace: dict[str, str] = {}


class Ok(_Header):
    """A request done, with the bytes it moved."""

    nbytes: int = 0


class Err(_Header):
    """A request refused or failed: a stable code and a message."""

    code: str
    message: str


HEADER_TYPES: dict[Kind, type[_Header]] = {
    Kind.SHIP: Ship,
    Kind.PULL: Pull,
    Kind.OPEN: Open,
    Kind.CLOSE: Close,
    Kind.LEASE: Lease,
    Kind.GRANTED: Granted,
    Kind.OK: Ok,
    Kind.DATA: Ok,
    Kind.ERR: Err,
}
_KIND_OF: dict[type, Kind] = {
    Ship: Kind.SHIP,
    Pull: Kind.PULL,
    Open: Kind.OPEN,
    Close: Kind.CLOSE,
    Lease: Kind.LEASE,
    Granted: Kind.GRANTED,
    Ok: Kind.OK,
    Err: Kind.ERR,
}
_KIND_BYTES = {k: bytes([k]) for k in Kind}
_encoder = msgspec.msgpack.Encoder()
_decoders = {k: msgspec.msgpack.Decoder(t) for k, t in HEADER_TYPES.items()}
_any = msgspec.msgpack.Decoder()


def frames(header: _Header, macs: Macs | None = None) -> list[bytes]:
    """The frames of one message (prepend the peer identity on a ROUTER); with ``macs``,
    a third frame authenticates the first two (:mod:`services.transfer.data_auth`)."""
    out = [_KIND_BYTES[_KIND_OF[type(header)]], _encoder.encode(header)]
    if macs is not None:
        out.append(macs.sign(out))
    return out


def parse(parts: Sequence[Any], macs: Macs | None = None) -> tuple[Kind, Any]:
    """Split received frames (``zmq.Frame`` or bytes) into kind and typed header. With
    ``macs`` the message must carry a valid MAC frame, else WireError
    ``unauthenticated`` (nothing of it is decoded)."""
    bufs = [p.buffer if hasattr(p, "buffer") else memoryview(p) for p in parts]
    if macs is not None:
        if len(bufs) != 3 or not macs.check(bufs[:2], bufs[2]):
            raise WireError("message not authenticated", code="unauthenticated")
        bufs = bufs[:2]
    if len(bufs) != 2 or len(bufs[0]) != 1:
        rid = _guess_id(bufs[1]) if len(bufs) > 2 and len(bufs[0]) == 1 else -1
        raise WireError(
            f"expected [kind][header] (coordination only, no payload), got {len(bufs)} frames",
            req_id=rid,
        )
    try:
        kind = Kind(bufs[0][0])
    except ValueError:
        raise WireError(f"unknown frame kind {bufs[0][0]}", req_id=_guess_id(bufs[1])) from None
    try:
        header = _decoders[kind].decode(bufs[1])
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise WireError(f"bad {kind.name} header: {e}", req_id=_guess_id(bufs[1])) from None
    return kind, header


def _guess_id(raw: memoryview) -> int:
    try:
        obj = _any.decode(raw)
    except msgspec.DecodeError:
        return -1
    rid = obj.get("id") if isinstance(obj, dict) else None
    return rid if isinstance(rid, int) else -1


def scatter(src: Sequence[memoryview], dst: Sequence[memoryview]) -> int:
    """Copy the concatenation of ``src`` into the concatenation of ``dst`` (equal sizes);
    one memcpy per overlapping piece, never per byte. Returns the byte count."""
    total = sum(len(s) for s in src)
    want = sum(len(d) for d in dst)
    if total != want:
        raise WireError(f"payload has {total} bytes, the slots take {want}")
    si = so = 0
    for d in dst:
        n = len(d)
        do = 0
        while do < n:
            s = src[si]
            take = min(n - do, len(s) - so)
            d[do : do + take] = s[so : so + take]
            do += take
            so += take
            if so == len(s):
                si += 1
                so = 0
    return total


# ---- object API (appended): a client's put/get of a whole object on one store, over
# the plain-TCP object endpoint (object_server), which frames the value after these ----


class ObjPut(_Header):
    """Store ``size`` payload bytes under ``key`` (replacing an older value)."""

    key: str
    size: int
    retention: int = 0


class ObjGet(_Header):
    """Answered DATA with the value of ``key`` (ERR ``missing`` when it is not here)."""

    key: str


HEADER_TYPES[Kind.OBJ_PUT] = ObjPut
HEADER_TYPES[Kind.OBJ_GET] = ObjGet
_KIND_OF[ObjPut] = Kind.OBJ_PUT
_KIND_OF[ObjGet] = Kind.OBJ_GET
_decoders[Kind.OBJ_PUT] = msgspec.msgpack.Decoder(ObjPut)
_decoders[Kind.OBJ_GET] = msgspec.msgpack.Decoder(ObjGet)
