"""RDMA backend over pyverbs: one-sided RDMA WRITE/READ on reliable-connected QPs.

Skipped at run time, with the reason, where pyverbs is missing or no RDMA device
exists (``available()``). The code path is unit-tested against a fake verbs module
(tests/unit/fake_verbs.py).
"""

from services.store.transport.base import Availability
from services.store.transport.rdma import verbs
from services.store.transport.rdma.engine import RdmaReceiver, RdmaSender


def available() -> Availability:
    return verbs.discover()[0]


__all__ = ["RdmaReceiver", "RdmaSender", "available"]
