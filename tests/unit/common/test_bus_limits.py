"""A message over the server's max_payload gets a clear error, never a hang or a dropped
connection: on a real nats-server with a small max_payload."""

import msgspec
import pytest

from perigee.natsd import NatsServer
from services.common import bus

LIMIT = 64 * 1024


class Ask(msgspec.Struct, frozen=True):
    size: int


class Blob(msgspec.Struct, frozen=True):
    data: bytes


@pytest.fixture(scope="module")
def small_server():
    with NatsServer(max_payload=LIMIT) as srv:
        yield srv


async def test_publish_over_max_payload_is_a_clear_error_and_the_connection_stays(small_server):
    nc = await bus.connect(small_server.url, name="t")
    try:
        assert nc.max_payload == LIMIT  # from the server's INFO
        sub = await nc.subscribe("t.big")
        with pytest.raises(bus.PayloadTooLarge) as e:
            await bus.publish(nc, "t.big", Blob(data=b"x" * (2 * LIMIT)))
        assert "t.big" in str(e.value) and f"max_payload of {LIMIT} bytes" in str(e.value)
        assert e.value.size > LIMIT
        await bus.publish(nc, "t.big", Blob(data=b"small"))
        msg = await sub.next_msg(timeout=5)
        assert msgspec.json.decode(msg.data, type=Blob).data == b"small"
        assert nc.is_connected
    finally:
        await nc.close()


async def test_headers_count_toward_max_payload(small_server):
    """nats.py checks the payload alone; the server counts the headers too and would
    close the connection (and every request on it would wait out its timeout)."""
    nc = await bus.connect(small_server.url, name="t")
    try:
        data = b"x" * (LIMIT - 10)
        with pytest.raises(bus.PayloadTooLarge):
            await bus.send(nc, "t.h", data, headers={"traceparent": "0" * 55})
        await bus.send(nc, "t.h", data)  # the same payload without headers fits
        await nc.flush()
        assert nc.is_connected
    finally:
        await nc.close()


async def test_a_reply_over_max_payload_is_an_error_reply_not_a_timeout(small_server):
    srv = await bus.connect(small_server.url, name="server")
    cli = await bus.connect(small_server.url, name="client")
    subs = bus.Subscriptions(srv)
    try:

        async def handler(ask: Ask, _m) -> Blob:
            return Blob(data=b"y" * ask.size)

        await subs.serve("t.ask", Ask, handler)
        ok = await bus.request(cli, "t.ask", Ask(size=10), Blob, timeout=10)
        assert ok.data == b"y" * 10
        with pytest.raises(bus.RemoteError) as e:
            await bus.request(cli, "t.ask", Ask(size=2 * LIMIT), Blob, timeout=10)
        assert e.value.code == "payload_too_large"
        assert f"max_payload of {LIMIT} bytes" in str(e.value)
        # A request too large to send fails at once, before the bus.
        with pytest.raises(bus.PayloadTooLarge):
            await bus.request(cli, "t.ask", Blob(data=b"z" * (2 * LIMIT)), Blob, timeout=10)
        assert srv.is_connected and cli.is_connected
    finally:
        await subs.close()
        await srv.close()
        await cli.close()


async def test_a_handler_whose_own_publish_is_too_large_answers_why(small_server):
    srv = await bus.connect(small_server.url, name="server")
    cli = await bus.connect(small_server.url, name="client")
    subs = bus.Subscriptions(srv)
    try:

        async def handler(ask: Ask, _m) -> Ask:
            await bus.publish(srv, "t.fanout", Blob(data=b"w" * ask.size))
            return ask

        await subs.serve("t.fan", Ask, handler)
        with pytest.raises(bus.RemoteError) as e:
            await bus.request(cli, "t.fan", Ask(size=2 * LIMIT), Ask, timeout=10)
        assert e.value.code == "payload_too_large" and "t.fanout" in str(e.value)
    finally:
        await subs.close()
        await srv.close()
        await cli.close()
