"""The transfer engine's backends behind one Sender/Receiver interface.

``backends()`` says which backends can run on this machine and, for those that
cannot, why (RDMA without a device is skipped, never an error at import time).
``make_sender(name, **opts)`` / ``make_receiver(name, **opts)`` build one.
``register(...)`` adds a backend from outside the package (the tests' in-process
fake), so nothing test-only ships in it.
"""

from collections.abc import Callable
from typing import Any

from services.transfer.backends.contract import (
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

BACKENDS = ("tcp", "shm", "rdma")

_Factories = tuple[Callable[..., Sender], Callable[..., Receiver]]
_extra: dict[str, tuple[Callable[[], Availability], _Factories]] = {}


def register(
    name: str,
    available: Callable[[], Availability],
    sender: Callable[..., Sender],
    receiver: Callable[..., Receiver],
) -> None:
    if name in BACKENDS:
        raise ValueError(f"backend {name!r} is built in")
    _extra[name] = (available, (sender, receiver))


def availability(name: str) -> Availability:
    if name == "tcp":
        from services.transfer.backends import tcp

        return tcp.available()
    if name == "shm":
        from services.transfer.backends import shm

        return shm.available()
    if name == "rdma":
        from services.transfer.backends.rdma import verbs

        return verbs.discover()[0]
    if name in _extra:
        return _extra[name][0]()
    have = ", ".join((*BACKENDS, *_extra))
    return Availability(False, f"unknown backend {name!r} (have {have})")


def backends() -> dict[str, Availability]:
    return {name: availability(name) for name in (*BACKENDS, *_extra)}


def _factories(name: str) -> _Factories:
    if name == "tcp":
        from services.transfer.backends.tcp import TcpReceiver, TcpSender

        return TcpSender, TcpReceiver
    if name == "shm":
        from services.transfer.backends.shm import ShmReceiver, ShmSender

        return ShmSender, ShmReceiver
    if name == "rdma":
        from services.transfer.backends.rdma import RdmaReceiver, RdmaSender

        return RdmaSender, RdmaReceiver
    if name in _extra:
        return _extra[name][1]
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
