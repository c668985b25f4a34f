"""Request/reply over one ZeroMQ DEALER socket, many requests in flight at once.

Used by a worker to talk to its node's store and by a store to talk to its peers.
Lifecycle: ``Channel(ctx, addr)`` connects; ``request()`` sends, parks a future under
the request id and waits (with a deadline) for the reader task to hand it the
reply; ``close()`` (or a timeout, which usually means the peer is gone) fails every
waiting request. ``PeerPool`` keeps at most ``max_peers`` channels, least recently
used closed first.

``ZMQ_IMMEDIATE`` keeps messages from queueing on a connection that is not up, so a
request to a dead peer waits for the deadline instead of being delivered, stale, to
whatever comes up at that address later.
"""

import asyncio
import os
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import structlog
import zmq
import zmq.asyncio

from services.transfer import data_auth, wire
from services.transfer.local_channel import LocalChannel
from services.transfer.requests import ChannelError, Requests

log = structlog.get_logger()


def next_id() -> int:
    """A request id (random: a stranger cannot guess one in flight)."""
    return data_auth.new_id()


def tune(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.SNDBUF, 4 << 20)
    sock.setsockopt(zmq.RCVBUF, 4 << 20)
    sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)


class Channel(Requests):
    """Requests over ZeroMQ, every message MAC'd with the run's data key (``macs``; by
    default this process's, :func:`services.transfer.data_auth.data_key`); a reply without a
    valid MAC is dropped."""

    def __init__(
        self, ctx: zmq.asyncio.Context, addr: str, macs: data_auth.Macs | None = None
    ) -> None:
        super().__init__(addr)
        self.macs = macs or data_auth.Macs(data_auth.data_key())
        self.sock = ctx.socket(zmq.DEALER)
        tune(self.sock)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)
        self.sock.connect(addr)
        self._reader = asyncio.get_running_loop().create_task(self._read(), name=f"channel:{addr}")

    async def _send(self, header: Any) -> None:
        await self.sock.send_multipart(wire.frames(header, self.macs))

    async def _read(self) -> None:
        try:
            while True:
                parts = await self.sock.recv_multipart(copy=False)
                try:
                    kind, header = wire.parse(parts, self.macs)
                except wire.WireError as e:
                    log.warning("bad_reply", addr=self.addr, error=str(e))
                    continue
                self._deliver(kind, header)
        except (asyncio.CancelledError, zmq.ZMQError):
            pass
        finally:
            self._fail_all()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._reader.cancel()
        self._fail_all()
        self.sock.close(linger=0)

    async def aclose(self) -> None:
        self.close()
        try:
            await self._reader
        except asyncio.CancelledError:
            pass


class PeerPool:
    """One channel per peer address, at most ``max_peers``, least recently used evicted
    (a channel with requests in flight is only evicted when every channel is busy).

    ``local_path(addr)``: the Unix socket of the store at ``addr`` when it shares this
    host (``local_channel``); a request to it then takes that socket instead of ZeroMQ,
    whose I/O thread on each side adds two thread wake-ups a message. A socket that
    cannot be reached, or a file this user does not own (anyone may create files in
    /dev/shm: a reply there is trusted as a MAC'd one is), keeps ZeroMQ for that path."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        max_peers: int = 64,
        macs: data_auth.Macs | None = None,
        local_path: Callable[[str], str] | None = None,
    ) -> None:
        self.ctx = ctx
        self.macs = macs
        self.max_peers = max(1, max_peers)
        self.local_path = local_path
        self._peers: OrderedDict[str, Requests] = OrderedDict()
        self._no_local: set[str] = set()  # paths that could not be used (bounded below)
        self._connecting: dict[str, asyncio.Future[Requests | None]] = {}

    def __len__(self) -> int:
        return len(self._peers)

    def get(self, addr: str) -> Requests:
        """The ZeroMQ channel to ``addr`` (or the local one already open to it)."""
        ch = self._peers.get(addr)
        if ch is not None and not ch.closed:
            self._peers.move_to_end(addr)
            return ch
        return self._put(addr, Channel(self.ctx, addr, self.macs))

    def _put(self, addr: str, ch: Requests) -> Requests:
        self._peers.pop(addr, None)
        while len(self._peers) >= self.max_peers:
            victim = next((a for a, c in self._peers.items() if c.in_flight == 0), None)
            victim = victim or next(iter(self._peers))
            self._peers.pop(victim).close()
        self._peers[addr] = ch
        return ch

    async def _channel(self, addr: str) -> Requests:
        ch = self._peers.get(addr)
        if ch is not None and not ch.closed:
            self._peers.move_to_end(addr)
            return ch
        path = self.local_path(addr) if self.local_path is not None else ""
        if path and path not in self._no_local:
            # One connection however many requests find none: the others wait for it.
            pending = self._connecting.get(path)
            if pending is None:
                pending = asyncio.ensure_future(self._connect(addr, path))
                self._connecting[path] = pending
                pending.add_done_callback(lambda _t: self._connecting.pop(path, None))
            local = await asyncio.shield(pending)
            if local is not None:
                return local
        return self.get(addr)

    async def _connect(self, addr: str, path: str) -> Requests | None:
        try:
            if os.stat(path).st_uid != os.getuid():
                raise PermissionError(f"{path} belongs to another user")
            return self._put(addr, await LocalChannel.connect(path))
        except OSError as e:
            if len(self._no_local) >= 4096:
                self._no_local.clear()
            self._no_local.add(path)
            log.info("peer_socket_unusable", addr=addr, path=path, error=str(e))
            return None

    async def request(self, addr: str, header: Any, timeout: float = 5.0) -> tuple[wire.Kind, Any]:
        return await (await self._channel(addr)).request(header, timeout)

    async def send(self, addr: str, header: Any, timeout: float = 5.0) -> None:
        """Send ``header``, which gets no reply; ChannelError when it cannot go out."""
        try:
            async with asyncio.timeout(timeout):
                await (await self._channel(addr)).send(header)
        except TimeoutError:
            raise ChannelError(
                "timeout", f"could not send to {addr} within {timeout:.1f}s"
            ) from None

    async def aclose(self) -> None:
        for pending in list(self._connecting.values()):
            pending.cancel()
        peers, self._peers = list(self._peers.values()), OrderedDict()
        for ch in peers:
            if isinstance(ch, Channel):
                await ch.aclose()
            else:
                ch.close()
