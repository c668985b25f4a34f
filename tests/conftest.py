import os

import pytest

from perigee.natsd import NatsServer
from services.transfer import data_auth

# One data key for the session: stores the tests start and the clients in this process
# share it, as a run's services do (perigee up draws one per run).
os.environ.setdefault(data_auth.ENV, data_auth.new_key())


@pytest.fixture(scope="session")
def nats_server():
    """One real nats-server for the whole test session."""
    with NatsServer() as server:
        yield server


@pytest.fixture
def nats_url(nats_server) -> str:
    return nats_server.url
