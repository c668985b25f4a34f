"""Client-side object API over the stores (Mooncake Store's put / get / remove /
change_replica), with replicas on distinct nodes.

    objs = await ObjectClient.connect(nc, ["p0", "p1", "d0"])
    await objs.put("key", b"value", replicas=2)   # straight to the 2 top-ranked stores
    await objs.get("key")                          # first store (in rank order) that has it
    await objs.change_replica("key", 3)            # copies / removals over NATS
    await objs.remove("key")

Placement is :mod:`services.store.pool.replicas` (rendezvous hashing over the live nodes):
no master, every client agrees. Values travel in one request and one reply over the
store's plain-TCP object endpoint (``StoreInfo.obj_addr``), on one of a few pooled
connections per store, each opened with an object HELLO under the run's data key
(:func:`services.transfer.data_auth.obj_hello`; without it the store closes the connection); copies between stores move through the stores' transfer
engine. Control (stat, remove, replicate) goes over NATS request/reply.
"""

import asyncio
import socket

from nats.aio.client import Client as NATS

from bus_schemas import subjects
from bus_schemas.control import ObjectDone, ObjectKey, ObjectReplicate, Refused, StoreInfo
from services.common.bus import request
from services.common.errors import CodedError
from services.store.client.store_client import TransferError, fetch_info
from services.store.pool import replicas
from services.transfer import data_auth, object_frames, wire
from services.transfer.channel import ChannelError, next_id


class ObjectError(CodedError, RuntimeError):
    """An object put or get that failed; ``code`` is the stable reason."""


_KIND = {wire.ObjPut: wire.Kind.OBJ_PUT, wire.ObjGet: wire.Kind.OBJ_GET}


def _split(addr: str) -> tuple[str, int]:
    host, _, port = addr.removeprefix("tcp://").rpartition(":")
    return host.strip("[]"), int(port)


class _TcpLink:
    """One plain-TCP connection to a store's object endpoint, one request at a time,
    awaited inline. Any failure closes it (a late reply must not be read as the next
    one's)."""

    def __init__(self, addr: str, key: bytes | None = None) -> None:
        self.addr = addr
        self.key = key or data_auth.data_key()
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, header, payload, timeout: float):
        try:
            async with asyncio.timeout(timeout):
                if self.writer is None:
                    host, port = _split(self.addr)
                    self.reader, self.writer = await asyncio.open_connection(host, port)
                    sock = self.writer.get_extra_info("socket")
                    if sock is not None:
                        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    self.writer.write(data_auth.obj_hello(self.key, self.addr))  # with the request
                assert self.reader is not None
                self.writer.write(object_frames.encode(_KIND[type(header)], header, payload))
                n = int.from_bytes(await self.reader.readexactly(4), "little")
                frame = memoryview(await self.reader.readexactly(n))
            kind, reply, data = object_frames.decode(frame)
        except (TimeoutError, OSError, asyncio.IncompleteReadError, wire.WireError) as e:
            self.close()
            code = "timeout" if isinstance(e, TimeoutError) else "closed"
            raise ChannelError(
                code, f"object request to {self.addr}: {e or type(e).__name__}"
            ) from None
        if kind == wire.Kind.ERR:
            raise ChannelError(reply.code, reply.message)
        return kind, reply, [data] if len(data) else []

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


class _LinkPool:
    """Plain-TCP links to one store's object endpoint: a request takes an idle one, or
    opens another while fewer than ``max_links`` are in use, else waits its turn."""

    def __init__(self, addr: str, max_links: int, key: bytes | None = None) -> None:
        self.addr = addr
        self.key = key
        self._idle: list[_TcpLink] = []
        self._slots = asyncio.Semaphore(max_links)
        self.opened = 0

    async def request(self, header, payload, timeout: float):
        try:
            if self._slots.locked():  # every link busy: wait, within the request's time
                async with asyncio.timeout(timeout):
                    await self._slots.acquire()
            else:
                await self._slots.acquire()
        except TimeoutError:
            raise ChannelError(
                "timeout", f"object request to {self.addr}: every link busy for {timeout:.1f}s"
            ) from None
        link = self._idle.pop() if self._idle else None
        if link is None:
            link = _TcpLink(self.addr, self.key)
            self.opened += 1
        try:
            return await link.request(header, payload, timeout)
        except ChannelError:
            raise  # a failed link closed itself; one answered with an error is fine
        except BaseException:
            link.close()  # cancelled mid-request: its reply may still arrive
            raise
        finally:
            if link.writer is not None:
                self._idle.append(link)
            self._slots.release()

    def close(self) -> None:
        for link in self._idle:
            link.close()
        self._idle.clear()


class ObjectClient:
    """put / get / remove / change_replica over the stores, replicas on distinct nodes."""

    def __init__(
        self,
        nc: NATS,
        infos: dict[str, StoreInfo],
        timeout_s: float,
        max_links: int = 8,
        key: bytes | None = None,
    ) -> None:
        self.nc = nc
        self.infos = infos
        self.timeout_s = timeout_s
        self.key = key or data_auth.data_key()  # the run's data key: the object HELLO's MAC
        self._links = {
            n: _LinkPool(i.obj_addr, max_links, self.key) for n, i in infos.items() if i.obj_addr
        }

    async def _request(self, node: str, header, payload=()):
        links = self._links.get(node)
        if links is None:
            raise ChannelError("unavailable", f"store {node} serves no object endpoint")
        return await links.request(header, payload, self.timeout_s)

    @classmethod
    async def connect(
        cls, nc: NATS, nodes: list[str], *, timeout: float = 10.0, op_timeout_s: float = 5.0
    ) -> "ObjectClient":
        infos = await asyncio.gather(*(fetch_info(nc, n, timeout) for n in nodes))
        return cls(nc, {i.node: i for i in infos}, op_timeout_s)

    @property
    def nodes(self) -> list[str]:
        return list(self.infos)

    def placement(self, key: str) -> list[str]:
        return replicas.rank(key, self.nodes)

    async def put(
        self, key: str, value: bytes | memoryview, replicas: int = 1, retention: int = 0
    ) -> list[str]:
        """Store ``value`` on the ``replicas`` top-ranked nodes; returns them."""
        if not 1 <= replicas <= len(self.infos):
            raise ObjectError(
                "bad_request", f"replicas must be 1..{len(self.infos)}, got {replicas}"
            )
        nodes = self.placement(key)[:replicas]
        if replicas == 1:
            await self._put(nodes[0], key, value, retention)
        else:
            await asyncio.gather(*(self._put(n, key, value, retention) for n in nodes))
        return nodes

    async def _put(self, node: str, key: str, value: bytes | memoryview, retention: int) -> None:
        h = wire.ObjPut(id=next_id(), key=key, size=len(value), retention=retention)
        try:
            await self._request(node, h, [value])
        except ChannelError as e:
            raise ObjectError(e.code, f"put {key!r} on {node}: {e.message}") from None

    async def get(self, key: str) -> bytes:
        """The value, from the first node in rank order that has it (KeyError if none)."""
        last = "no store"
        for node in self.placement(key):
            try:
                _, _, data = await self._request(node, wire.ObjGet(id=next_id(), key=key))
            except ChannelError as e:
                last = f"{node}: {e.code}"
                continue
            return b"".join(bytes(d) for d in data)
        raise KeyError(f"object {key!r} not found ({last})")

    async def holders(self, key: str) -> set[str]:
        replies = await asyncio.gather(
            *(
                request(
                    self.nc,
                    subjects.store_ctl(n, "obj.stat"),
                    ObjectKey(key=key),
                    ObjectDone,
                    timeout=self.timeout_s,
                )
                for n in self.nodes
            ),
            return_exceptions=True,
        )
        return {r.node for r in replies if isinstance(r, ObjectDone) and r.present}

    async def remove(self, key: str) -> list[str]:
        """Remove ``key`` everywhere; returns the nodes that had it."""
        replies = await asyncio.gather(
            *(
                request(
                    self.nc,
                    subjects.store_ctl(n, "obj.remove"),
                    ObjectKey(key=key),
                    ObjectDone,
                    timeout=self.timeout_s,
                )
                for n in self.nodes
            ),
            return_exceptions=True,
        )
        return sorted(r.node for r in replies if isinstance(r, ObjectDone) and r.present)

    async def change_replica(self, key: str, n: int) -> list[str]:
        """Make exactly the ``n`` top-ranked live nodes hold ``key``; returns them."""
        if not 0 <= n <= len(self.infos):
            raise ObjectError("bad_request", f"replicas must be 0..{len(self.infos)}, got {n}")
        held = await self.holders(key)
        if not held:
            raise KeyError(f"object {key!r} not found")
        p = replicas.plan(key, self.nodes, held, n)
        results = await asyncio.gather(
            *(
                request(
                    self.nc,
                    subjects.store_ctl(dst, "obj.replicate"),
                    ObjectReplicate(key=key, source_node=src, dest_node=dst),
                    ObjectDone | Refused,
                    timeout=self.timeout_s,
                )
                for src, dst in p.copies
            )
        )
        bad = [r for r in results if isinstance(r, Refused)]
        if bad:
            raise ObjectError(bad[0].reason, bad[0].message)
        await asyncio.gather(
            *(
                request(
                    self.nc,
                    subjects.store_ctl(node, "obj.remove"),
                    ObjectKey(key=key),
                    ObjectDone,
                    timeout=self.timeout_s,
                )
                for node in p.removes
            )
        )
        return p.keep

    async def close(self) -> None:
        for links in self._links.values():
            links.close()


class SyncObjectClient:
    """Blocking put / get for callers without an event loop (the shape of Mooncake's
    Python store API), over each store's plain-TCP object endpoint. Placement is the
    same rendezvous ranking as :class:`ObjectClient`; remove and change_replica need
    NATS and live there.

        objs = SyncObjectClient({"p0": info.obj_addr, ...})   # or .of(async_client)
        objs.put("key", b"value", replicas=2); objs.get("key"); objs.close()
    """

    def __init__(
        self, addrs: dict[str, str], timeout_s: float = 5.0, key: bytes | None = None
    ) -> None:
        self.addrs = dict(addrs)
        self.timeout_s = timeout_s
        self.key = key or data_auth.data_key()
        self._socks: dict[str, socket.socket] = {}
        self._hdr = memoryview(bytearray(4))

    @classmethod
    def of(cls, client: ObjectClient) -> "SyncObjectClient":
        missing = [n for n, i in client.infos.items() if not i.obj_addr]
        if missing:
            raise ObjectError("bad_request", f"stores {missing} serve no object endpoint")
        return cls({n: i.obj_addr for n, i in client.infos.items()}, client.timeout_s, client.key)

    def placement(self, key: str) -> list[str]:
        return replicas.rank(key, list(self.addrs))

    def _sock(self, node: str) -> socket.socket:
        s = self._socks.get(node)
        if s is None:
            s = socket.create_connection(_split(self.addrs[node]), timeout=self.timeout_s)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._socks[node] = s
            s.sendall(data_auth.obj_hello(self.key, self.addrs[node]))
        return s

    def _request(self, node: str, header, payload=()) -> memoryview:
        try:
            s = self._sock(node)
            s.sendall(object_frames.encode(_KIND[type(header)], header, payload))
            _recv_into(s, self._hdr)
            frame = memoryview(bytearray(int.from_bytes(self._hdr, "little")))
            _recv_into(s, frame)
            kind, reply, data = object_frames.decode(frame)
        except (OSError, ConnectionError, wire.WireError) as e:
            bad = self._socks.pop(node, None)
            if bad is not None:
                bad.close()
            code = "timeout" if isinstance(e, TimeoutError) else "closed"
            raise ObjectError(code, f"object request to {node}: {e}") from None
        if kind == wire.Kind.ERR:
            raise ObjectError(reply.code, reply.message)
        return data

    def put(
        self, key: str, value: bytes | memoryview, replicas: int = 1, retention: int = 0
    ) -> list[str]:
        if not 1 <= replicas <= len(self.addrs):
            raise ObjectError(
                "bad_request", f"replicas must be 1..{len(self.addrs)}, got {replicas}"
            )
        nodes = self.placement(key)[:replicas]
        for n in nodes:
            self._request(
                n, wire.ObjPut(id=next_id(), key=key, size=len(value), retention=retention), [value]
            )
        return nodes

    def get(self, key: str) -> bytes:
        last = "no store"
        for node in self.placement(key):
            try:
                data = self._request(node, wire.ObjGet(id=next_id(), key=key))
            except ObjectError as e:
                last = f"{node}: {e.code}"
                continue
            return bytes(data)
        raise KeyError(f"object {key!r} not found ({last})")

    def close(self) -> None:
        for s in self._socks.values():
            s.close()
        self._socks.clear()


def _recv_into(s: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = s.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("store closed the connection")
        got += n


__all__ = ["ObjectClient", "ObjectError", "SyncObjectClient", "TransferError"]
