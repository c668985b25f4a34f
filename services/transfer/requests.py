"""Requests in flight on one connection to a store, parked by id until their replies
come: what the ZeroMQ channel (``channel.Channel``) and the Unix socket
(``local_channel.LocalChannel``) share."""

import asyncio
from typing import Any

from services.common.errors import CodedError
from services.transfer import wire


class ChannelError(CodedError, RuntimeError):
    """A request to a peer store that failed (timeout, closed, the peer's ERR)."""


class Requests:
    """Requests in flight on one connection, parked by id until the reader hands each its
    reply: what :class:`Channel` (ZeroMQ) and ``local_channel.LocalChannel`` (the
    store's Unix socket) share. A subclass puts a request on the wire (``_send``),
    calls ``_deliver`` for each reply and ``_fail_all`` when the connection ends."""

    def __init__(self, addr: str) -> None:
        self.addr = addr
        self._pending: dict[int, asyncio.Future[tuple[wire.Kind, Any]]] = {}
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    async def _send(self, header: Any) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    async def request(self, header: Any, timeout: float = 5.0) -> tuple[wire.Kind, Any]:
        """Send one request and return its reply (kind OK or GRANTED); ERR raises
        :class:`ChannelError` with the peer's code; no reply in ``timeout`` raises
        ``ChannelError("timeout")`` and closes the channel."""
        if self._closed:
            raise ChannelError("closed", f"channel to {self.addr} is closed")
        fut: asyncio.Future[tuple[wire.Kind, Any]] = asyncio.get_running_loop().create_future()
        self._pending[header.id] = fut
        try:
            async with asyncio.timeout(timeout):
                await self._send(header)
                kind, reply = await fut
        except TimeoutError:
            self.close()
            raise ChannelError(
                "timeout", f"no reply from {self.addr} within {timeout:.1f}s (peer down?)"
            ) from None
        finally:
            self._pending.pop(header.id, None)
        if kind == wire.Kind.ERR:
            raise ChannelError(reply.code, reply.message)
        return kind, reply

    async def send(self, header: Any) -> None:
        """Send a message that gets no reply (a quiet CLOSE)."""
        if self._closed:
            raise ChannelError("closed", f"channel to {self.addr} is closed")
        await self._send(header)

    def _deliver(self, kind: wire.Kind, header: Any) -> None:
        fut = self._pending.get(header.id)
        if fut is not None and not fut.done():
            fut.set_result((kind, header))

    def _fail_all(self) -> None:
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ChannelError("closed", f"channel to {self.addr} closed"))
        self._pending.clear()
