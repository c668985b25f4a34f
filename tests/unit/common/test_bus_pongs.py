"""A flush that gave up (timed out, or its task cancelled) leaves its future in nats-py's
PONG queue; when the PONG comes, the connection must go on reading (bus.guard_pongs).
Real nats-server, real connections."""

import asyncio

import nats

from services.common import bus


async def gave_up_flush(nc) -> None:
    """What a flush that timed out leaves behind: its PING sent, its future cancelled."""
    future = asyncio.get_running_loop().create_future()
    future.cancel()
    await nc._send_ping(future)


async def echo_works(nc, responder) -> bool:
    async def answer(msg) -> None:
        await msg.respond(msg.data)

    sub = await responder.subscribe("pong.echo", cb=answer)
    await responder.flush()
    try:
        # A no-responders status is an answer too (the connection read it): the server
        # had not put the responder's interest where this publish looked yet (seen once
        # in a fresh-clone make test). A connection that stopped reading times out.
        for _ in range(20):
            try:
                reply = await nc.request("pong.echo", b"still reading", timeout=5)
                return reply.data == b"still reading"
            except nats.errors.NoRespondersError:
                await responder.flush()
        return False
    except nats.errors.TimeoutError:
        return False
    finally:
        await sub.unsubscribe()


async def test_a_pong_for_a_flush_that_gave_up_leaves_the_connection_reading(nats_url):
    responder = await nats.connect(nats_url)
    nc = await bus.connect(nats_url, name="pongs")
    try:
        await gave_up_flush(nc)
        await nc.flush(timeout=5)  # its PONG comes after the one for the cancelled future
        assert await echo_works(nc, responder)
        assert nc._reading_task is not None and not nc._reading_task.done()
    finally:
        await nc.close()
        await responder.close()
