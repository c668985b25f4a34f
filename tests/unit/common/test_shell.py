"""services.common.shell.serve on a real nats-server: a service that fails exits 1
after its stop ran; a start-up that fails raises its own error, with stop still run."""

import argparse
import asyncio
import signal

import pytest

from services.common import shell


def args(nats_url: str) -> argparse.Namespace:
    return argparse.Namespace(log_level="WARNING", nats=nats_url, metrics_port=0)


class Fake:
    def __init__(self, nc, fail_start: bool = False, fail_stop: bool = False) -> None:
        self.nc = nc
        self.calls: list[str] = []
        self.failed = asyncio.Event()
        self.fail_start, self.fail_stop = fail_start, fail_stop

    async def start(self) -> None:
        self.calls.append("start")
        assert self.nc.is_connected  # built on a live connection
        if self.fail_start:
            raise RuntimeError("no store")
        asyncio.get_running_loop().call_soon(self.failed.set)  # a background task died

    async def stop(self) -> None:
        self.calls.append("stop")
        if self.fail_stop:
            raise AttributeError("half-built")


@pytest.fixture(autouse=True)
def keep_signal_handlers():
    """serve installs SIGINT/SIGTERM handlers on the test's loop: put pytest's back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


async def test_a_service_that_fails_exits_1_after_its_stop(nats_url):
    made: list[Fake] = []

    def build(nc):
        made.append(Fake(nc))
        return made[-1]

    code = await shell.serve("fake", args(nats_url), build, failed=lambda s: s.failed)
    assert code == 1
    assert made[0].calls == ["start", "stop"]
    assert made[0].nc.is_closed  # drained


async def test_a_failed_start_up_raises_its_own_error_and_still_stops(nats_url):
    made: list[Fake] = []

    def build(nc):
        made.append(Fake(nc, fail_start=True, fail_stop=True))
        return made[-1]

    with pytest.raises(RuntimeError, match="no store"):  # not stop's AttributeError
        await shell.serve("fake", args(nats_url), build, failed=lambda s: s.failed)
    assert made[0].calls == ["start", "stop"]
    assert made[0].nc.is_closed
