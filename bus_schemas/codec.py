"""JSON on the wire, decoded strictly: one typed decoder per message type, made once.

JSON rather than msgpack so that any NATS client (``nats pub``, nats-py, a browser)
can speak the request subject; msgspec's JSON is fast enough that the bus hop is
dominated by the network round trip, not by encoding.
"""

from typing import Any, TypeVar, cast

import msgspec

T = TypeVar("T")

_encoder = msgspec.json.Encoder()
_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}


class BadMessage(ValueError):
    """A bus payload that is not valid JSON or does not match its schema."""


def encode(msg: Any) -> bytes:
    return _encoder.encode(msg)


def decoder(tp: type[T] | Any) -> msgspec.json.Decoder[Any]:
    dec = _decoders.get(tp)
    if dec is None:
        dec = _decoders[tp] = msgspec.json.Decoder(tp)
    return dec


def decode(data: bytes, tp: type[T] | Any) -> T:
    try:
        return cast(T, decoder(tp).decode(data))
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        name = getattr(tp, "__name__", str(tp))
        raise BadMessage(f"invalid {name}: {e}") from None
