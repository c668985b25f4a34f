"""How every service talks to NATS: connect, subscribe with strict decoding, reply,
and shut down on a signal.

A handler gets a decoded message and may return a reply struct; a payload that does
not decode gets an error reply (or is logged and dropped when there is no reply
subject). A handler that raises is logged and answered with an error; the service
keeps running either way.
"""

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload
from urllib.parse import unquote, urlsplit

import msgspec
import nats
import nats.js.errors
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg as NatsMsg
from opentelemetry import trace

from bus_schemas import subjects
from bus_schemas.codec import BadMessage, decode, encode
from bus_schemas.control import BusReconnected
from bus_schemas.requests import Error, ErrorCode
from services.common import metrics, shutdown
from services.common.errors import CodedError
from services.common.placeholders import refuse_placeholder
from services.common.tasks import cancel_and_wait
from tracing import extract, inject, tracer

T = TypeVar("T")

log = structlog.get_logger()
# A message with this header is a readiness probe (perigee.stack): answered empty, not
# decoded, not logged as bad input.
PROBE_HEADER = "Perigee-Probe"

Handler = Callable[[Any, NatsMsg], Awaitable[Any]]
# Called instead of the default error reply when a payload does not decode.
BadHandler = Callable[[NatsMsg, BadMessage], Awaitable[None]]

ERROR_HEADER = "Perigee-Error"
# nats.py micro's error convention (nats.micro.request), so that the nats CLI and any
# micro-aware client read our request/reply errors: a status code and a description.
MICRO_ERROR_HEADER = "Nats-Service-Error"
MICRO_ERROR_CODE_HEADER = "Nats-Service-Error-Code"
_MICRO_CODES = {"bad_request": "400", "payload_too_large": "413", "internal": "500"}

# Periodic telemetry (load reports, KV events, store announces) is not traced: a
# consumer span per message would be a new trace ten times a second per worker.
UNTRACED_PREFIXES = (
    subjects.NS + ".load.",
    subjects.NS + ".kv.events.",
)
_ANNOUNCE_SUFFIX = subjects.STORE_ANNOUNCE.rsplit("*", 1)[1]  # perigee.store.<node>.announce


def traced_subject(subject: str) -> bool:
    return not (
        subject.startswith(UNTRACED_PREFIXES)
        or (subject.startswith(subjects.NS + ".store.") and subject.endswith(_ANNOUNCE_SUFFIX))
    )


# A service's own NATS login when its URL carries none (perigee up, Kubernetes Secrets).
USER_ENV, PASSWORD_ENV = "NATS_USER", "NATS_PASSWORD"
# A password read from this file at every (re)connect: a Kubernetes projected token,
# which the kubelet rotates in place (services.authn).
PASSWORD_FILE_ENV = "NATS_PASSWORD_FILE"


def password_from_file(path: str) -> Callable[[], str]:
    def read() -> str:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()

    return read


def servers_and_login(url: str) -> tuple[list[str], str | None, str | None]:
    """``url``: one NATS URL or a comma list (every server of a cluster). The login is
    the URL's own (``nats://user:password@host``), else ``$NATS_USER``/``$NATS_PASSWORD``.
    It is passed as an option rather than left in the URLs: a server the client
    discovers from the cluster has none in its URL."""
    servers, user, password = [], None, None
    for u in (x.strip() for x in url.split(",")):
        if not u:
            continue
        parts = urlsplit(u if "://" in u else f"nats://{u}")
        if parts.username is not None and user is None:
            user, password = unquote(parts.username), unquote(parts.password or "")
        servers.append(f"{parts.scheme}://{parts.netloc.rsplit('@', 1)[-1]}")
    if user is None and os.environ.get(USER_ENV):
        user, password = os.environ[USER_ENV], os.environ.get(PASSWORD_ENV, "")
    return servers, user, password


def js_replicas() -> int:
    """Replicas for a JetStream stream a service creates: ``$PERIGEE_JS_REPLICAS``, set by
    ``perigee up`` to min(3, servers) (``--nats-cluster 3``: 3), else 1."""
    try:
        return max(1, int(os.environ.get("PERIGEE_JS_REPLICAS", "1")))
    except ValueError:
        return 1


async def js_publish(
    js: Any,
    subject: str,
    data: bytes,
    *,
    msg_id: str,
    timeout: float = 30.0,
    headers: dict[str, str] | None = None,
) -> Any:
    """Publish to a JetStream stream until it acks. Each try carries the same
    ``Nats-Msg-Id``, so the stream stores the message once (its duplicate window) even
    when an ack was lost; the tries ride over a stream leader's election after a server
    of the cluster dies (a few seconds with no leader). Past ``timeout`` the last error
    is raised."""
    deadline = asyncio.get_running_loop().time() + timeout
    wait = 0.1
    while True:
        left = deadline - asyncio.get_running_loop().time()
        try:
            return await js.publish(
                subject,
                data,
                timeout=max(0.1, min(2.0, left)),
                headers={**(headers or {}), "Nats-Msg-Id": msg_id},
            )
        except (
            nats.errors.TimeoutError,
            nats.errors.NoRespondersError,
            nats.js.errors.NoStreamResponseError,
            nats.js.errors.ServiceUnavailableError,
            nats.errors.ConnectionReconnectingError,
            nats.errors.OutboundBufferLimitError,
        ):
            if asyncio.get_running_loop().time() + wait > deadline:
                raise
            await asyncio.sleep(wait)
            wait = min(1.0, wait * 2)


def inbox_prefix(user: str | None) -> str:
    """A login's inbox prefix: the bus lets each login read only ``_INBOX.<user>.>``
    (perigee.natsauth), so no service reads another's replies; no login: nats-py's own."""
    return f"_INBOX.{_token(user)}" if user else "_INBOX"


def _token(text: str) -> str:
    """``text`` as one subject token (no dots, wildcards or spaces)."""
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in text) or "_"


async def connect(url: str, name: str, *, kind: str = "client", sender: str = "") -> NATS:
    """A connection to ``url`` (its login from the URL or the environment) named
    ``name``. On a reconnect it publishes BusReconnected on
    ``subjects.bus_reconnected(kind, sender or name)``: the sender is what the gateway
    resumes requests of (a worker's instance, a store's node, a conductor's id), and the
    bus lets each login publish only its own."""
    notice_subject = subjects.bus_reconnected(kind, _token(sender or name))

    async def on_error(e: Exception) -> None:
        log.warning("nats_error", error=str(e))

    box: list[NATS] = []

    async def on_reconnected() -> None:
        # Messages to and from it while it had no server may be lost: say so, so that
        # what waits on them is resumed (services.gateway.replies).
        nc = box[0]
        server = str(nc.connected_url.netloc) if nc.connected_url else ""
        log.warning("nats_reconnected", server=server)
        try:
            await publish(nc, notice_subject, BusReconnected(client=name, server=server))
        except Exception as e:  # noqa: BLE001 - best effort; the bus may be going again
            log.warning("nats_reconnected_notice_failed", error=str(e))

    servers, user, password = servers_and_login(url)
    refuse_placeholder(f"the NATS password of user {user!r}", password, "NATS_PASSWORD or the URL")
    login: dict[str, Any] = {"user": user, "password": password} if user is not None else {}
    if user is not None and not password and os.environ.get(PASSWORD_FILE_ENV):
        login["password"] = password_from_file(os.environ[PASSWORD_FILE_ENV])
    nc = await nats.connect(
        servers,
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.2,
        error_cb=on_error,
        reconnected_cb=on_reconnected,
        inbox_prefix=inbox_prefix(user),
        **login,
    )
    box.append(nc)
    guard_pongs(nc)
    return nc


def guard_pongs(nc: NATS) -> None:
    """Make a PONG for a flush that was cancelled or timed out harmless.

    nats-py (2.16) keeps each flush's future in ``_pongs`` and sets the result of the next
    one when a PONG comes, also when the flush gave up on it (its ``wait_for`` timed out,
    or the awaiting task was cancelled: a service stopping mid-start). ``set_result`` on
    the cancelled future raises InvalidStateError, which ends the connection's read loop:
    the client reads nothing more while it still looks connected. Seen as a traceback in
    a conductor stopped during start-up (test_clean_stop). The same fix nats-py made for
    its flusher (nats.py#636): skip a future that is already done."""

    async def process_pong() -> None:
        if nc._pongs:
            future = nc._pongs.pop(0)
            if not future.done():
                future.set_result(True)
            nc._pongs_received += 1
            nc._pings_outstanding = 0

    nc._process_pong = process_pong  # type: ignore[method-assign]


async def sync(nc: NATS) -> None:
    """Return once the server has processed every SUB sent so far.

    nats-py writes a flush's PING straight to the socket, possibly ahead of a SUB still
    in its buffer; the second round trip is ordered after it."""
    await nc.flush()
    await nc.flush()


class ErrorReply(msgspec.Struct, frozen=True, kw_only=True):
    """Sent with header ``Perigee-Error`` when a request could not be handled."""

    error: str
    message: str


def error_reply(kind: str, message: str) -> tuple[bytes, dict[str, str]]:
    """An error reply: an :class:`ErrorReply` body, our kind header, and micro's pair."""
    headers = {
        ERROR_HEADER: kind,
        MICRO_ERROR_HEADER: message.replace("\r", " ").replace("\n", " ")[:256],
        MICRO_ERROR_CODE_HEADER: _MICRO_CODES.get(kind, "500"),
    }
    return encode(ErrorReply(error=kind, message=message)), headers


class PayloadTooLarge(ValueError):
    """A message larger than the server takes (its ``max_payload``). Raised before
    sending: the server would otherwise drop the connection, and a request would wait
    out its timeout."""

    def __init__(self, subject: str, size: int, limit: int) -> None:
        super().__init__(
            f"message on {subject} is {size} bytes, over the NATS server's "
            f"max_payload of {limit} bytes"
        )
        self.subject, self.size, self.limit = subject, size, limit


def check_size(nc: NATS, subject: str, data: bytes, headers: dict[str, str] | None) -> None:
    """The server counts headers in ``max_payload``; nats.py checks the payload only."""
    size = len(data)
    if headers:
        size += 12 + sum(len(k) + len(v) + 4 for k, v in headers.items())  # NATS/1.0 block
    if size > nc.max_payload:
        raise PayloadTooLarge(subject, size, nc.max_payload)


async def send(
    nc: NATS, subject: str, data: bytes, reply: str = "", headers: dict[str, str] | None = None
) -> None:
    check_size(nc, subject, data, headers)
    await nc.publish(subject, data, reply=reply, headers=headers)


async def publish(nc: NATS, subject: str, msg: Any, reply: str = "") -> None:
    await send(nc, subject, encode(msg), reply=reply, headers=inject())


async def flush_soon() -> None:
    """Let the connection write what was just published before the caller goes on.

    nats.py only queues a publish; its flusher task writes the queue once the
    publishing task yields. A handler that publishes what a request's first token
    waits for and then has more to do (more messages, books, spans) would hold that
    message back for as long: it yields once here, and the flusher, woken by the
    publish, runs first. Costs one write more when more follows."""
    await asyncio.sleep(0)


@overload
async def request(
    nc: NATS, subject: str, msg: Any, reply_type: type[T], timeout: float = 2.0
) -> T: ...


@overload
async def request(  # a union of reply types (e.g. TxReply): one of them
    nc: NATS, subject: str, msg: Any, reply_type: Any, timeout: float = 2.0
) -> Any: ...


async def request(nc: NATS, subject: str, msg: Any, reply_type: Any, timeout: float = 2.0) -> Any:
    """Request/reply with strict decoding; an error reply raises :class:`RemoteError`
    (``payload_too_large`` when the reply would not fit on the bus), a message too large
    to send :class:`PayloadTooLarge`."""
    data, headers = encode(msg), inject()
    check_size(nc, subject, data, headers)
    resp = await nc.request(subject, data, timeout=timeout, headers=headers)
    if resp.headers and ERROR_HEADER in resp.headers:
        err: ErrorReply = decode(resp.data, ErrorReply)
        raise RemoteError(err.error, err.message)
    return decode(resp.data, reply_type)


class RemoteError(CodedError, RuntimeError):
    """The service answered with an error reply (``code``: its kind, e.g. bad_request)."""


async def send_error(
    nc: NATS,
    service: str,
    request_id: str,
    reply: str,
    code: int,
    message: str,
    retry_after_s: float | None = None,
) -> None:
    """Fail a request on its stream subject (and count it by reason)."""
    metrics.count_rejection(service, code, message)
    await publish(
        nc,
        reply,
        Error(
            request_id=request_id,
            code=ErrorCode(code),
            message=message,
            retry_after_s=retry_after_s,
        ),
    )


class Subscriptions:
    """Owns a service's subscriptions and the tasks its handlers spawn."""

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self._subs: list[Any] = []
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Awaitable[Any], name: str | None = None) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        if name:
            task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task_failed", task=task.get_name(), error=repr(task.exception()))

    async def serve(
        self,
        subject: str,
        msg_type: Any,
        handler: Handler,
        *,
        queue: str = "",
        concurrent: bool = False,
        span_name: str | None = None,
        on_bad: BadHandler | None = None,
        traced: bool | None = None,
    ) -> None:
        """Subscribe ``handler`` to ``subject``.

        ``concurrent`` runs each message in its own task (for handlers that wait on
        other services); otherwise messages are handled in arrival order. ``on_bad``
        replaces the default ``Perigee-Error`` reply to a payload that does not decode
        (e.g. to answer in the subject's own stream protocol). Each message is handled
        in a consumer span joined to the sender's trace, unless ``traced`` is False
        (default: :func:`traced_subject`).
        """
        name = span_name or subject
        if traced is None:
            traced = traced_subject(subject)

        async def run(m: NatsMsg) -> None:
            if m.headers and PROBE_HEADER in m.headers:
                if m.reply:  # a readiness probe: the reply proves the subscription is live
                    await self.nc.publish(m.reply, b"")
                return
            try:
                obj = decode(m.data, msg_type)
            except BadMessage as e:
                log.warning("bad_message", subject=m.subject, error=str(e))
                if on_bad is not None:
                    try:
                        await on_bad(m, e)
                    except Exception:  # noqa: BLE001 - never let bad input kill the service
                        log.exception("bad_message_handler_failed", subject=m.subject)
                elif m.reply:
                    data, hdrs = error_reply("bad_request", str(e))
                    await self.nc.publish(m.reply, data, headers=hdrs)
                return
            ctx = extract(m.headers)
            span = (
                tracer().start_as_current_span(name, context=ctx, kind=trace.SpanKind.CONSUMER)
                if traced
                else contextlib.nullcontext()
            )
            with span:
                try:
                    out = await handler(obj, m)
                except PayloadTooLarge as e:  # what it sent on would not fit on the bus
                    log.warning("payload_too_large", subject=m.subject, error=str(e))
                    if m.reply:
                        data, hdrs = error_reply("payload_too_large", str(e))
                        await self.nc.publish(m.reply, data, headers=hdrs)
                    return
                except Exception as e:  # noqa: BLE001 - a handler bug must not kill the service
                    log.exception("handler_failed", subject=m.subject)
                    if m.reply:
                        data, hdrs = error_reply("internal", f"{type(e).__name__}: {e}")
                        await self.nc.publish(m.reply, data, headers=hdrs)
                    return
                if out is not None and m.reply:
                    await self._reply(m, encode(out))

        async def cb(m: NatsMsg) -> None:
            if concurrent:
                self.spawn(run(m), name=f"{subject}:handler")
            else:
                await run(m)

        self._subs.append(await self.nc.subscribe(subject, queue=queue, cb=cb))
        await sync(self.nc)

    def adopt(self, sub: Any) -> None:
        """A subscription made elsewhere (e.g. a JetStream consumer) closed with these."""
        self._subs.append(sub)

    async def _reply(self, m: NatsMsg, data: bytes) -> None:
        try:
            await send(self.nc, m.reply, data, headers=inject())
        except PayloadTooLarge as e:  # the requester gets why, not a timeout
            log.warning("reply_too_large", subject=m.subject, size=e.size, limit=e.limit)
            err, hdrs = error_reply("payload_too_large", str(e))
            await self.nc.publish(m.reply, err, headers=hdrs)

    async def close(self) -> None:
        for s in self._subs:
            try:
                await s.unsubscribe()
            except Exception:  # noqa: BLE001 - connection may already be gone
                pass
        await cancel_and_wait(list(self._tasks))


def install_signal_handlers(stop: asyncio.Event, bound_s: float = shutdown.BOUND_S) -> None:
    """SIGTERM/SIGINT set ``stop`` (or cancel start-up), bounded: see
    :mod:`services.common.shutdown`."""
    shutdown.install(stop, bound_s)


DRAIN_S = 2.0


async def drain(nc: NATS, timeout: float = DRAIN_S) -> None:
    """Drain the connection if the bus is there, else close it; never longer than
    about ``timeout``. nats.py's own drain is not bounded on a dead bus: it swallows
    the cancellation from a timeout and then waits for a flush (10 s)."""
    if nc.is_closed:
        return
    if nc.is_connected and await _within(nc.drain(), timeout):
        return
    if not nc.is_closed:
        await _within(nc.close(), 1.0)


async def _within(coro: Awaitable[Any], timeout: float) -> bool:
    """Run ``coro`` for at most ``timeout``; past that it is cancelled and left behind
    (not awaited: it may not end). True when it finished without an error."""
    task = asyncio.ensure_future(coro)
    done, _ = await asyncio.wait({task}, timeout=timeout)
    if not done:
        task.cancel()
        log.warning("nats_close_timed_out", timeout_s=timeout)
        return False
    if task.cancelled() or task.exception() is not None:
        return False
    return True
