"""The store's transfer engine: backends behind one Sender/Receiver interface.

``backends()`` says which backends can run on this machine and, for those that
cannot, why (RDMA without a device is skipped, never an error at import time).
``make_sender(name, **opts)`` / ``make_receiver(name, **opts)`` build one.
"""

from collections.abc import Callable
from typing import Any

from services.store.transport.base import (
    Availability,
    Opcode,
    Poll,
    Receiver,
    Region,
    Request,
    Sender,
    Ticket,
    TransportError,
)

BACKENDS = ("tcp", "shm", "rdma", "fake")


def availability(name: str) -> Availability:
    if name == "tcp":
        from services.store.transport import tcp

        return tcp.available()
    if name == "shm":
        from services.store.transport import shm

        return shm.available()
    if name == "rdma":
        from services.store.transport.rdma import verbs

        return verbs.discover()[0]
    if name == "fake":
        return Availability(True)
    return Availability(False, f"unknown backend {name!r} (have {', '.join(BACKENDS)})")


def backends() -> dict[str, Availability]:
    return {name: availability(name) for name in BACKENDS}


def _factories(name: str) -> tuple[Callable[..., Sender], Callable[..., Receiver]]:
    if name == "tcp":
        from services.store.transport.tcp import TcpReceiver, TcpSender

        return TcpSender, TcpReceiver
    if name == "shm":
        from services.store.transport.shm import ShmReceiver, ShmSender

        return ShmSender, ShmReceiver
    if name == "rdma":
        from services.store.transport.rdma import RdmaReceiver, RdmaSender

        return RdmaSender, RdmaReceiver
    if name == "fake":
        from services.store.transport.fake import FakeReceiver, FakeSender

        return FakeSender, FakeReceiver
    raise TransportError("unavailable", f"unknown backend {name!r}")


def make_sender(name: str, **opts: Any) -> Sender:
    return _factories(name)[0](**opts)


def make_receiver(name: str, **opts: Any) -> Receiver:
    return _factories(name)[1](**opts)


__all__ = [
    "BACKENDS",
    "Availability",
    "Opcode",
    "Poll",
    "Receiver",
    "Region",
    "Request",
    "Sender",
    "Ticket",
    "TransportError",
    "availability",
    "backends",
    "make_receiver",
    "make_sender",
]
