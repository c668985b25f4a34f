import os

import pytest

from perigee.natsd import NatsServer
from services.transfer import data_auth

# One data key for the session: stores the tests start and the clients in this process
# share it, as a run's services do (perigee up draws one per run).
os.environ.setdefault(data_auth.ENV, data_auth.new_key())
# This process's tracer provider is installed once, by the first test that runs a
# service's shell in it (tests/unit/common/test_shell.py), and keeps its sampler for the
# whole session: every root is sampled here, as the default rate limit's few tokens a
# second would go to the roots of the tests before one that reads its spans. (A stack a
# test starts sets its services' own rate: tests/e2e/conftest.py.)
os.environ.setdefault("PERIGEE_TRACE_RATE", "0")


@pytest.fixture(scope="session")
def nats_server():
    """One real nats-server for the whole test session."""
    with NatsServer() as server:
        yield server


@pytest.fixture
def nats_url(nats_server) -> str:
    return nats_server.url
