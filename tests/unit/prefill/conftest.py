"""Fixtures of the prefill unit tests."""

import nats
import pytest


@pytest.fixture
async def conns(nats_url):
    """A store's and a worker's connections to the test's nats-server."""
    store_nc, worker_nc = await nats.connect(nats_url), await nats.connect(nats_url)
    yield store_nc, worker_nc
    await store_nc.close()
    await worker_nc.close()
