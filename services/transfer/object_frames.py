"""The object endpoint's frames, the same both ways (the store's
:mod:`services.store.node.object_server` and the clients'
:mod:`services.store.client.object_client`): ``u32 length`` (of what follows), ``u8
kind`` (:class:`services.transfer.wire.Kind`), ``u16 header length``, the msgpack header
(:mod:`services.transfer.wire`'s ObjPut / ObjGet / Ok / Err), then the payload bytes."""

import struct
from typing import Any

import msgspec

from services.transfer import wire

PREFIX = struct.Struct("<IBH")  # length, kind, header length
MAX_FRAME = 1 << 30
_enc = msgspec.msgpack.Encoder()


def encode(kind: wire.Kind, header: Any, payload: list[Any] | tuple = ()) -> bytes:
    hdr = _enc.encode(header)
    n = sum(len(p) for p in payload)
    return b"".join([PREFIX.pack(1 + 2 + len(hdr) + n, kind, len(hdr)), hdr, *payload])


def decode(frame: memoryview) -> tuple[wire.Kind, Any, memoryview]:
    """``frame`` is what follows the length word."""
    if len(frame) < 3:
        raise wire.WireError("short frame")
    kind_b, hlen = frame[0], int.from_bytes(frame[1:3], "little")
    try:
        kind = wire.Kind(kind_b)
    except ValueError:
        raise wire.WireError(f"unknown frame kind {kind_b}") from None
    if 3 + hlen > len(frame):
        raise wire.WireError("header runs past the frame")
    try:
        header = msgspec.msgpack.decode(frame[3 : 3 + hlen], type=wire.HEADER_TYPES[kind])
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise wire.WireError(f"bad {kind.name} header: {e}") from None
    return kind, header, frame[3 + hlen :]
