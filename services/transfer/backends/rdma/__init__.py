"""RDMA backend over pyverbs: one-sided RDMA WRITE/READ on reliable-connected QPs.

Skipped at run time, with the reason, where pyverbs is missing or no RDMA device
exists (``available()``). The code path is unit-tested against a fake verbs module
(tests/unit/fake_verbs.py).
"""

from services.transfer.backends.contract import Availability
from services.transfer.backends.rdma import verbs
from services.transfer.backends.rdma.queue_pairs import RdmaReceiver, RdmaSender


def available() -> Availability:
    return verbs.discover()[0]


__all__ = ["RdmaReceiver", "RdmaSender", "available"]
