"""bus.drain ends whatever the connection does: nats.py's own drain, timed out on a dead
bus, swallows its cancellation and goes on waiting (for a flush)."""

import asyncio

from services.common import bus


class StuckNats:
    """A connection whose drain never ends and ignores cancellation, like nats.py's on a
    bus that died under it; ``release`` lets it end once the test is over."""

    def __init__(self, connected: bool = True) -> None:
        self.is_connected = connected
        self.is_closed = False
        self.drains = 0
        self.closes = 0
        self.release = asyncio.Event()

    async def drain(self) -> None:
        self.drains += 1
        while not self.release.is_set():
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                continue

    async def close(self) -> None:
        self.closes += 1
        self.is_closed = True


async def test_a_drain_that_never_ends_is_left_behind_and_the_connection_closed():
    nc = StuckNats()
    await bus.drain(nc, timeout=0.05)
    assert (nc.drains, nc.closes, nc.is_closed) == (1, 1, True)
    nc.release.set()
    await asyncio.sleep(0)


async def test_a_reconnecting_connection_is_closed_without_a_drain():
    nc = StuckNats(connected=False)
    await bus.drain(nc)
    assert (nc.drains, nc.closes) == (0, 1)


async def test_a_closed_connection_is_left_alone():
    nc = StuckNats()
    nc.is_closed = True
    await bus.drain(nc)
    assert (nc.drains, nc.closes) == (0, 0)
