"""PeerPool: a same-host peer's requests take its Unix socket, anything else ZeroMQ."""

import asyncio
import os
import tempfile

import pytest
import zmq
import zmq.asyncio

from services.transfer import channel as channel_mod
from services.transfer import data_auth, local_channel, wire
from services.transfer.channel import Channel, ChannelError, PeerPool
from services.transfer.local_channel import LocalChannel, LocalServer

KEY = b"k" * 32


def _open(tx: str = "t") -> wire.Open:
    return wire.Open(
        id=channel_mod.next_id(), tx=tx, epoch=1, slots=[0], offset=0, length=8, write=True
    )


class _Peer:
    """A peer store's two doors: a ZeroMQ ROUTER (MAC'd) and a Unix socket; each answers
    OK and counts what it served."""

    def __init__(self, ctx: zmq.asyncio.Context, path: str) -> None:
        self.macs = data_auth.Macs(KEY)
        self.router = ctx.socket(zmq.ROUTER)
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.addr = f"tcp://127.0.0.1:{port}"
        self.path = path
        self.served = {"zmq": 0, "local": 0}
        self.local = LocalServer(path, self._local)
        self._task: asyncio.Task | None = None

    def _local(self, kind, header, reply) -> None:
        self.served["local"] += 1
        reply(wire.Ok(id=header.id))

    async def start(self) -> None:
        await self.local.start()
        self._task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            ident, *rest = await self.router.recv_multipart()
            _, header = wire.parse(rest, self.macs)
            self.served["zmq"] += 1
            await self.router.send_multipart(
                [ident, *wire.frames(wire.Ok(id=header.id), self.macs)]
            )

    async def close(self) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self.local.close()
        self.router.close(linger=0)


@pytest.fixture
async def peer():
    ctx = zmq.asyncio.Context()
    with tempfile.TemporaryDirectory(prefix="perigee-peers-") as d:
        p = _Peer(ctx, os.path.join(d, "peer.ctl"))
        await p.start()
        yield ctx, p
        await p.close()
    ctx.term()


async def test_a_peer_with_a_socket_of_ours_is_asked_over_it(peer):
    ctx, p = peer
    pool = PeerPool(ctx, macs=data_auth.Macs(KEY), local_path={p.addr: p.path}.get)
    for _ in range(3):
        kind, reply = await pool.request(p.addr, _open(), timeout=5)
        assert kind == wire.Kind.OK
    assert p.served == {"zmq": 0, "local": 3}
    assert isinstance(pool.get(p.addr), LocalChannel) and len(pool) == 1  # one connection
    await pool.aclose()


async def test_requests_that_find_no_connection_open_one_together(peer, monkeypatch):
    ctx, p = peer
    made = []
    opened = local_channel._ServerConn.connection_made
    monkeypatch.setattr(
        local_channel._ServerConn,
        "connection_made",
        lambda self, t: (made.append(self), opened(self, t))[-1],
    )
    pool = PeerPool(ctx, macs=data_auth.Macs(KEY), local_path={p.addr: p.path}.get)
    replies = await asyncio.gather(*(pool.request(p.addr, _open(), timeout=5) for _ in range(8)))
    assert [k for k, _ in replies] == [wire.Kind.OK] * 8 and p.served["local"] == 8
    assert len(made) == 1  # no connection opened and then orphaned by a racing one
    await pool.aclose()


async def test_no_socket_or_none_announced_keeps_zeromq(peer):
    ctx, p = peer
    paths = {p.addr: p.path + ".missing"}
    pool = PeerPool(ctx, macs=data_auth.Macs(KEY), local_path=lambda a: paths.get(a, ""))
    await pool.request(p.addr, _open(), timeout=5)
    assert p.served == {"zmq": 1, "local": 0} and isinstance(pool.get(p.addr), Channel)
    await pool.aclose()
    plain = PeerPool(ctx, macs=data_auth.Macs(KEY))  # no registry to ask: ZeroMQ
    await plain.request(p.addr, _open(), timeout=5)
    assert p.served == {"zmq": 2, "local": 0}
    await plain.aclose()


async def test_a_socket_file_of_another_user_is_not_believed(peer, monkeypatch):
    ctx, p = peer
    # anyone may create a file in /dev/shm: one that is not ours could answer anything
    monkeypatch.setattr(channel_mod.os, "getuid", lambda: os.stat(p.path).st_uid + 1)
    pool = PeerPool(ctx, macs=data_auth.Macs(KEY), local_path={p.addr: p.path}.get)
    await pool.request(p.addr, _open(), timeout=5)
    await pool.request(p.addr, _open(), timeout=5)
    assert p.served == {"zmq": 2, "local": 0}
    await pool.aclose()


async def test_a_peer_that_went_away_fails_the_request_and_the_next_reconnects(peer):
    ctx, p = peer
    paths = {p.addr: p.path}
    pool = PeerPool(ctx, macs=data_auth.Macs(KEY), local_path=lambda a: paths.get(a, ""))
    await pool.request(p.addr, _open(), timeout=5)
    first = pool.get(p.addr)
    await p.local.close()  # the peer restarts: its old socket is gone, a new one comes up
    p.local = LocalServer(p.path + ".2", p._local)
    await p.local.start()
    paths[p.addr] = p.path + ".2"
    first.close()  # what the kernel's end of the connection tells the reader
    with pytest.raises(ChannelError) as e:
        await first.request(_open(), timeout=5)
    assert e.value.code == "closed"
    await pool.request(p.addr, _open(), timeout=5)
    assert p.served == {"zmq": 0, "local": 2} and pool.get(p.addr) is not first
    await pool.aclose()
