"""Client-side object API over the stores (Mooncake Store's put / get / remove /
change_replica), with replicas on distinct nodes.

    objs = await ObjectClient.connect(nc, ["p0", "p1", "d0"])
    await objs.put("key", b"value", replicas=2)   # straight to the 2 top-ranked stores
    await objs.get("key")                          # first store (in rank order) that has it
    await objs.change_replica("key", 3)            # copies / removals over NATS
    await objs.remove("key")

Placement is :mod:`services.store.replicas` (rendezvous hashing over the live nodes):
no master, every client agrees. Values travel over the stores' ZeroMQ data plane
(one request, one reply); control (stat, remove, replicate) over NATS request/reply.
"""

import asyncio

import zmq.asyncio
from nats.aio.client import Client as NATS

from bus_schemas import subjects
from bus_schemas.control import ObjectDone, ObjectKey, ObjectReplicate, Refused, StoreInfo
from services.common.bus import request
from services.store import replicas, wire
from services.store.channel import ChannelError, PeerPool, next_id
from services.store.client import TransferError, fetch_info


class ObjectError(RuntimeError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class ObjectClient:
    def __init__(self, nc: NATS, infos: dict[str, StoreInfo], timeout_s: float) -> None:
        self.nc = nc
        self.infos = infos
        self.timeout_s = timeout_s
        self.peers = PeerPool(zmq.asyncio.Context.instance(), max_peers=max(8, len(infos)))

    @classmethod
    async def connect(cls, nc: NATS, nodes: list[str], *, timeout: float = 10.0,
                      op_timeout_s: float = 5.0) -> "ObjectClient":
        infos = await asyncio.gather(*(fetch_info(nc, n, timeout) for n in nodes))
        return cls(nc, {i.node: i for i in infos}, op_timeout_s)

    @property
    def nodes(self) -> list[str]:
        return list(self.infos)

    def placement(self, key: str) -> list[str]:
        return replicas.rank(key, self.nodes)

    async def put(self, key: str, value: bytes | memoryview, replicas: int = 1,
                  retention: int = 0) -> list[str]:
        """Store ``value`` on the ``replicas`` top-ranked nodes; returns them."""
        if not 1 <= replicas <= len(self.infos):
            raise ObjectError("bad_request", f"replicas must be 1..{len(self.infos)}, got {replicas}")
        nodes = self.placement(key)[:replicas]
        if replicas == 1:
            await self._put(nodes[0], key, value, retention)
        else:
            await asyncio.gather(*(self._put(n, key, value, retention) for n in nodes))
        return nodes

    async def _put(self, node: str, key: str, value: bytes | memoryview, retention: int) -> None:
        h = wire.ObjPut(id=next_id(), key=key, size=len(value), retention=retention)
        try:
            await self.peers.request(self.infos[node].data_addr, h, [value], timeout=self.timeout_s)
        except ChannelError as e:
            raise ObjectError(e.code, f"put {key!r} on {node}: {e.message}") from None

    async def get(self, key: str) -> bytes:
        """The value, from the first node in rank order that has it (KeyError if none)."""
        last = "no store"
        for node in self.placement(key):
            try:
                _, _, data = await self.peers.request(
                    self.infos[node].data_addr, wire.ObjGet(id=next_id(), key=key),
                    timeout=self.timeout_s)
            except ChannelError as e:
                last = f"{node}: {e.code}"
                continue
            return b"".join(bytes(d) for d in data) if len(data) != 1 else bytes(data[0])
        raise KeyError(f"object {key!r} not found ({last})")

    async def holders(self, key: str) -> set[str]:
        replies = await asyncio.gather(*(
            request(self.nc, subjects.store_ctl(n, "obj.stat"), ObjectKey(key=key), ObjectDone,
                    timeout=self.timeout_s) for n in self.nodes), return_exceptions=True)
        return {r.node for r in replies if isinstance(r, ObjectDone) and r.present}

    async def remove(self, key: str) -> list[str]:
        """Remove ``key`` everywhere; returns the nodes that had it."""
        replies = await asyncio.gather(*(
            request(self.nc, subjects.store_ctl(n, "obj.remove"), ObjectKey(key=key), ObjectDone,
                    timeout=self.timeout_s) for n in self.nodes), return_exceptions=True)
        return sorted(r.node for r in replies if isinstance(r, ObjectDone) and r.present)

    async def change_replica(self, key: str, n: int) -> list[str]:
        """Make exactly the ``n`` top-ranked live nodes hold ``key``; returns them."""
        if not 0 <= n <= len(self.infos):
            raise ObjectError("bad_request", f"replicas must be 0..{len(self.infos)}, got {n}")
        held = await self.holders(key)
        if not held:
            raise KeyError(f"object {key!r} not found")
        p = replicas.plan(key, self.nodes, held, n)
        results = await asyncio.gather(*(
            request(self.nc, subjects.store_ctl(dst, "obj.replicate"),
                    ObjectReplicate(key=key, source_node=src, dest_node=dst),
                    ObjectDone | Refused, timeout=self.timeout_s) for src, dst in p.copies))
        bad = [r for r in results if isinstance(r, Refused)]
        if bad:
            raise ObjectError(bad[0].reason, bad[0].message)
        await asyncio.gather(*(
            request(self.nc, subjects.store_ctl(node, "obj.remove"), ObjectKey(key=key), ObjectDone,
                    timeout=self.timeout_s) for node in p.removes))
        return p.keep

    async def close(self) -> None:
        await self.peers.aclose()


__all__ = ["ObjectClient", "ObjectError", "TransferError"]
