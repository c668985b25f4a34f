import pytest

from perigee.natsd import NatsServer


@pytest.fixture(scope="session")
def nats_server():
    """One real nats-server for the whole test session."""
    with NatsServer() as server:
        yield server


@pytest.fixture
def nats_url(nats_server) -> str:
    return nats_server.url
