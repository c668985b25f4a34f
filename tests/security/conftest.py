"""Two real store processes (TCP only, so honest ships cross the TCP receiver that the
hostile tests poke at) on the session's nats-server, and what a stranger sees of them."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import nats
import pytest
import zmq

from services.store.client.store_client import StoreClient
from services.transfer import data_auth, wire
from tests.unit.store.test_store_integration import BB, BS, stop_store

ROOT = Path(__file__).resolve().parents[2]


def start_store(nats_url: str, node: str, log_dir: str) -> subprocess.Popen:
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "none", "PYTHONUNBUFFERED": "1"}
    with open(os.path.join(log_dir, f"{node}.log"), "wb") as log:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.store",
                *("--nats", nats_url, "--node", node),
                *("--block-size", str(BS), "--block-bytes", str(BB)),
                *("--capacity-blocks", "32", "--transports", "tcp"),
                *("--peer-timeout", "1.0", "--announce-interval", "0.5"),
                *("--log-level", "INFO"),
            ],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


@pytest.fixture(scope="module")
def stores(nats_server):
    with tempfile.TemporaryDirectory(prefix="perigee-security-") as logs:
        procs = {node: start_store(nats_server.url, node, logs) for node in ("ha", "hb")}
        try:
            yield procs
        finally:
            codes = {node: stop_store(p) for node, p in procs.items()}
            if any(codes.values()):
                for node in procs:
                    print(Path(logs, f"{node}.log").read_text()[-4000:])
            assert codes == {"ha": 0, "hb": 0}  # no hostile input crashed a store


@pytest.fixture
async def env(stores, nats_url):
    nc = await nats.connect(nats_url)
    a = await StoreClient.connect(nc, "ha", timeout=30)
    b = await StoreClient.connect(nc, "hb", timeout=30)
    yield nc, a, b
    await a.close()
    await b.close()
    await nc.close()


class Dealer:
    """A blocking DEALER on a store's ROUTER; ``macs`` signs (None: a stranger)."""

    def __init__(self, addr: str, macs: data_auth.Macs | None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 10_000)
        self.sock.connect(addr)
        self.macs = macs

    def send(self, parts: list[bytes]) -> None:
        self.sock.send_multipart(parts)

    def ask(self, header) -> tuple[wire.Kind, object]:
        """A signed request and its (signed) reply."""
        macs = self.macs or data_auth.Macs(data_auth.data_key())
        self.sock.send_multipart(wire.frames(header, macs))
        return wire.parse(self.sock.recv_multipart(), macs)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()
