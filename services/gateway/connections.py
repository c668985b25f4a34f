"""What aiohttp leaves open on a listening socket: a deadline on a request's headers and
a cap on open connections.

aiohttp gives a request's headers no deadline of their own: a client that sends half a
request line and then a byte a minute holds its socket and its handler until the
keep-alive timer (an hour by default) ends it. Here each connection is a
:class:`GuardedHandler`, aiohttp's own :class:`~aiohttp.web.RequestHandler` with

- a **header deadline**: a connection's request must have its headers complete
  ``header_timeout_s`` after the connection opened, or after the first byte of a later
  request on a kept-alive connection; one that does not is closed. (The body has its
  own deadline, in the gateway: ``body_timeout_s`` from the headers, then a 408.)
- a **connection cap**: past ``max_connections`` open connections a new one gets a
  ``503`` with ``Retry-After`` and is closed at once, before anything of it is read.

:class:`GuardedSite` listens with these handlers; :meth:`ConnectionGuard.middleware`
tells a handler when its request's headers are in (the handler runs) and when it is
done. An idle kept-alive connection is aiohttp's keep-alive timer's.
"""

import asyncio
import json
import resource
from typing import Any

import structlog
from aiohttp import web
from prometheus_client import Counter, Gauge

log = structlog.get_logger()

P = "perigee:"
OPEN = Gauge(P + "gateway_connections", "HTTP connections open at the gateway now.", registry=None)
REFUSED = Counter(
    P + "gateway_connections_refused",
    "Connections the gateway closed with 503 at once: --max-connections were open.",
    registry=None,
)
SLOW = Counter(
    P + "gateway_slow_clients",
    "Requests too slow to arrive, by phase: headers (the connection is closed) or body (408).",
    ["phase"],
    registry=None,
)
COLLECTORS = (OPEN, REFUSED, SLOW)

_BODY = json.dumps(
    {
        "error": {
            "message": "the gateway has its limit of connections open; retry shortly",
            "type": "server_error",
            "param": None,
            "code": "service_unavailable",
        }
    }
).encode()
REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(_BODY) + _BODY
)


class _Refuse(asyncio.Protocol):
    """A connection over the cap: the 503, then closed; nothing of it is read."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        REFUSED.inc()
        assert isinstance(transport, asyncio.Transport)
        transport.write(REFUSAL)
        transport.close()


class ConnectionGuard:
    """The open connections of one listening gateway and the limits on them."""

    def __init__(self, max_connections: int, header_timeout_s: float) -> None:
        if max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        if header_timeout_s <= 0:
            raise ValueError("header_timeout_s must be positive")
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.open = 0  # connections handed to a GuardedHandler and not yet lost
        self.refused = 0
        self.timed_out = 0  # connections closed for slow headers

    def protocol(self, server: web.Server, handler_kwargs: dict[str, Any]) -> asyncio.Protocol:
        """The protocol for a new connection (``loop.create_server``'s factory)."""
        if self.open >= self.max_connections:
            self.refused += 1
            return _Refuse()
        return GuardedHandler(server, guard=self, loop=asyncio.get_running_loop(), **handler_kwargs)

    @staticmethod
    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        """Outermost: the headers are in while the handler runs; the deadline stops."""
        proto = request.protocol
        if not isinstance(proto, GuardedHandler):
            return await handler(request)  # type: ignore[no-any-return]
        proto.request_started()
        try:
            return await handler(request)  # type: ignore[no-any-return]
        finally:
            proto.request_done()


class GuardedHandler(web.RequestHandler):
    """aiohttp's handler, counted against the cap, with a deadline on each request's
    headers (:class:`ConnectionGuard`)."""

    def __init__(self, manager: web.Server, *, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard
        self._deadline: asyncio.TimerHandle | None = None
        self._busy = False  # a request's handler runs
        self._counted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._guard.open += 1
        OPEN.inc()
        self._counted = True
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if not self._busy and self._deadline is None:
            self._arm()  # the first byte of a request on a kept-alive connection
        super().data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        if self._counted:
            self._counted = False
            self._guard.open -= 1
            OPEN.dec()
        super().connection_lost(exc)

    def request_started(self) -> None:
        self._busy = True
        self._disarm()

    def request_done(self) -> None:
        self._busy = False

    def _arm(self) -> None:
        self._disarm()
        loop = asyncio.get_running_loop()
        self._deadline = loop.call_later(self._guard.header_timeout_s, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        if self._busy or self.transport is None:
            return
        self._guard.timed_out += 1
        SLOW.labels("headers").inc()
        log.info("http_headers_timeout", timeout_s=self._guard.header_timeout_s)
        self.force_close()


class GuardedSite(web.TCPSite):
    """:class:`aiohttp.web.TCPSite` whose connections are :class:`GuardedHandler` s."""

    __slots__ = ("_guard", "_handler_kwargs")

    def __init__(
        self,
        runner: web.AppRunner,
        host: str,
        port: int,
        guard: ConnectionGuard,
        handler_kwargs: dict[str, Any],
        backlog: int = 128,
    ) -> None:
        super().__init__(runner, host, port, backlog=backlog)
        self._guard = guard
        self._handler_kwargs = handler_kwargs

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        server = self._runner.server
        assert server is not None
        guard, kwargs = self._guard, self._handler_kwargs
        self._server = await asyncio.get_running_loop().create_server(
            lambda: guard.protocol(server, kwargs), self._host, self._port, backlog=self._backlog
        )
        self._bound_port = self._server.sockets[0].getsockname()[1]


def raise_fd_limit(need: int) -> int:
    """Raise this process's soft limit on open files towards ``need`` (at most the hard
    limit), so ``--max-connections`` is reached before ``accept`` fails; the new soft
    limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        soft = want
    if soft != resource.RLIM_INFINITY and soft < need:
        log.warning("fd_limit_below_max_connections", limit=soft, need=need)
    return soft
