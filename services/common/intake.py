"""What admission and the conductor both do with a request off the bus, written once:
where its events go, what can be saved from a payload that does not decode and how it
is answered, how a request off a durable intake is consumed, and the prompt's block
hashes."""

import json
from collections.abc import Awaitable, Callable, Sequence

import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg as NatsMsg
from opentelemetry import trace

from bus_schemas.codec import BadMessage, decode
from bus_schemas.requests import ErrorCode, GenerateRequest
from services.common import bus
from services.common.hashing import block_hashes
from tracing import extract, tracer

log = structlog.get_logger(__name__)

# A service's handling of one request: (request, its message, off a durable intake?).
Handler = Callable[[GenerateRequest, NatsMsg, bool], Awaitable[None]]


def reply_to(body_reply: str, msg_reply: str | None) -> str:
    """Where a request's events go: its own ``reply_subject`` (it travels with the
    request when admission forwards it), else the NATS reply subject of the message."""
    return body_reply or msg_reply or ""


def reply_for(req: GenerateRequest, m: NatsMsg, durable: bool) -> str:
    """Where a request's events go. A stored message (durable intake) has no NATS
    reply (its ``m.reply`` is the stream's ack subject): the gateway's travels in the
    request."""
    return req.reply_subject if durable else reply_to(req.reply_subject, m.reply)


async def answer_malformed(
    nc: NATS, service: str, m: NatsMsg, err: BadMessage, *, durable: bool
) -> None:
    """Error 400 for a payload that does not decode, on the reply it names (on core
    NATS, else the message's own reply), so that a bus client is not left waiting."""
    log.warning("bad_message", subject=m.subject, error=str(err))
    request_id, reply = salvage(m.data)
    if not durable:
        reply = reply_to(reply, m.reply)
    if not reply:
        log.warning("bad_request_dropped", request_id=request_id, error=str(err))
        return
    await bus.send_error(nc, service, request_id, reply, ErrorCode.BAD_REQUEST, str(err))


async def consume_durable(
    nc: NATS, service: str, span_name: str, m: NatsMsg, handle: Handler
) -> None:
    """One request off a durable intake: decoded, handled under a consumer span, and
    acked only once handled, so one a service dies holding comes again. A malformed
    one is answered and terminated: no redelivery can make it decode."""
    try:
        req: GenerateRequest = decode(m.data, GenerateRequest)
    except BadMessage as e:
        await answer_malformed(nc, service, m, e, durable=True)
        await m.term()
        return
    with tracer().start_as_current_span(
        span_name, context=extract(m.headers), kind=trace.SpanKind.CONSUMER
    ):
        await handle(req, m, True)
    await m.ack()


def salvage(data: bytes) -> tuple[str, str]:
    """(request_id, reply_subject) from a payload that failed strict decoding, if any."""
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return "", ""
    if not isinstance(obj, dict):
        return "", ""
    rid, reply = obj.get("request_id"), obj.get("reply_subject")
    return (rid if isinstance(rid, str) else ""), (reply if isinstance(reply, str) else "")


def hashes_for(
    tokens: Sequence[int], given: Sequence[int] | None, given_size: int, block_size: int
) -> list[int]:
    """The chained hashes of ``tokens``' full blocks of ``block_size``: ``given`` when the
    client hashed with that size (``given_size`` 0 means it did), else computed here.
    ValueError when given hashes do not match the prompt's full blocks in number."""
    if given is None or given_size not in (0, block_size):
        return block_hashes(tokens, block_size)
    full = len(tokens) // block_size
    if len(given) != full:
        raise ValueError(
            f"block_hashes has {len(given)} entries, the prompt has {full} full blocks "
            f"of {block_size}"
        )
    return list(given)
