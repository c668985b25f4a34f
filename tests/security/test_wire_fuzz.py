"""Hypothesis against the wire of a running store: its ROUTER (signed and unsigned
frames), its Unix socket, its TCP receiver and its object server (with and without a
keyed HELLO). After
every batch the store still answers a signed request and an honest ship lands; the
fixture asserts both stores exit 0 at the end."""

import asyncio
import secrets
import socket

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bus_schemas.control import TxRole
from services.transfer import data_auth, wire
from services.transfer.backends.tcp.sender import parse_addr
from tests.security.conftest import Dealer
from tests.security.test_data_plane import grant, honest_objects, honest_ship
from tests.unit.store.test_store_integration import BS, tx

pytestmark = pytest.mark.timeout(120)
FUZZ = settings(
    max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None
)
frames_st = st.lists(st.binary(max_size=96), min_size=1, max_size=4)


def alive(addr: str) -> None:
    """A signed request gets its own reply (whatever fuzz replies are queued before it)."""
    d = Dealer(addr, None)
    try:
        probe = wire.Close(id=data_auth.new_id(), grant=1, ok=True)
        kind, err = d.ask(probe)
        assert kind == wire.Kind.ERR and err.id == probe.id
    finally:
        d.close()


async def test_router_fuzz(env):
    nc, a, b = env
    macs = data_auth.Macs(data_auth.data_key())
    d = Dealer(b.info.data_addr, None)

    @FUZZ
    @given(parts=frames_st, kind=st.integers(0, 255), signed=st.booleans())
    def fuzz(parts: list[bytes], kind: int, signed: bool) -> None:
        if signed:  # a keyed peer's garbage: parsed, answered with an ERR at most
            msg = [bytes([kind]), parts[0]]
            d.send([*msg, macs.sign(msg)])
        else:
            d.send(parts)

    try:
        await asyncio.to_thread(fuzz)
    finally:
        d.close()
    await asyncio.to_thread(alive, b.info.data_addr)
    await honest_ship(nc, a, b, 2001)


async def test_unix_socket_fuzz(env):
    nc, a, b = env
    path = a.info.ctl_path
    if not path:
        pytest.skip("this store has no Unix socket here")

    @FUZZ
    @given(chunks=st.lists(st.binary(max_size=128), min_size=1, max_size=4), framed=st.booleans())
    def fuzz(chunks: list[bytes], framed: bool) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(path)
        try:
            for c in chunks:
                s.sendall(len(c).to_bytes(4, "little") + c if framed else c)
        except OSError:
            pass  # the store dropped the connection: fine
        finally:
            s.close()

    await asyncio.to_thread(fuzz)
    await honest_ship(nc, a, b, 2002)


async def test_tcp_receiver_fuzz(env):
    nc, a, b = env
    dst = await tx(nc, "hb", TxRole.DECODE, [2003], BS)
    g = grant(b.info.data_addr, dst)
    addr = parse_addr(g.segments["tcp"])
    key = data_auth.data_key()

    @FUZZ
    @given(body=st.binary(max_size=512), keyed=st.booleans())
    def fuzz(body: bytes, keyed: bool) -> None:
        s = socket.create_connection(addr, timeout=5)
        try:
            if keyed:
                s.sendall(data_auth.hello(key, secrets.token_bytes(data_auth.SESSION_BYTES)))
            s.sendall(body)
            s.shutdown(socket.SHUT_WR)
            while s.recv(65536):  # whatever it answers, until it closes
                pass
        except OSError:
            pass
        finally:
            s.close()

    await asyncio.to_thread(fuzz)
    await asyncio.to_thread(alive, b.info.data_addr)
    await honest_ship(nc, a, b, 2004)


async def test_object_server_fuzz(env):
    nc, a, b = env
    obj_addr = a.info.obj_addr
    addr = parse_addr(obj_addr)
    key = data_auth.data_key()

    @FUZZ
    @given(
        body=st.binary(max_size=512),
        keyed=st.booleans(),
        framed=st.lists(st.tuples(st.integers(0, 255), st.binary(max_size=64)), max_size=3),
    )
    def fuzz(body: bytes, keyed: bool, framed: list[tuple[int, bytes]]) -> None:
        s = socket.create_connection(addr, timeout=5)
        try:
            if keyed:  # a holder's garbage: parsed, answered with an ERR at most
                s.sendall(data_auth.obj_hello(key, obj_addr))
            for kind, raw in framed:  # frames that are framed, with any kind and header
                s.sendall((1 + 2 + len(raw)).to_bytes(4, "little") + bytes([kind]))
                s.sendall(len(raw).to_bytes(2, "little") + raw)
            s.sendall(body)
            s.shutdown(socket.SHUT_WR)
            while s.recv(65536):  # whatever it answers, until it closes
                pass
        except OSError:
            pass
        finally:
            s.close()

    await asyncio.to_thread(fuzz)
    await asyncio.to_thread(honest_objects, obj_addr, "after-fuzz")
    await honest_ship(nc, a, b, 2005)
