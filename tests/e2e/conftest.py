"""End-to-end fixtures: real nats-server and real service processes, started through
perigee.stack (the code path of ``perigee up``). Each stack gets its own nats-server:
two stacks on one bus would share queue groups."""

import pytest

from perigee.natsd import free_port
from perigee.stack import Stack, StackConfig


def make_stack(tmp_path_factory, name: str, **kw) -> Stack:
    """A stack for one test module; the mock engine unless ``engine="vllm"`` is given
    (``perigee up`` defaults to vllm, these tests rely on the mock's speed)."""
    kw.setdefault("engine", "mock")
    # Every request traced at any rate: a test that reads a request's spans must find
    # them whatever the tests before it sent (the default caps new traces a second).
    kw.setdefault("trace_rate", 0.0)
    cfg = StackConfig(port=free_port(), log_dir=str(tmp_path_factory.mktemp(f"logs-{name}")), **kw)
    return Stack(cfg)


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    """1 prefill + 1 decode, mock engine at 100x the paper's A800 speed."""
    s = make_stack(tmp_path_factory, "main", engine="mock", prefill=1, decode=1, speedup="100")
    s.start()
    yield s
    s.stop()
