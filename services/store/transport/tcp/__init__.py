"""TCP backend: several parallel streams per peer, large transfers sliced across them."""

from services.store.transport.base import Availability
from services.store.transport.tcp.receiver import TcpReceiver
from services.store.transport.tcp.sender import TcpSender


def available() -> Availability:
    return Availability(True)


__all__ = ["TcpReceiver", "TcpSender", "available"]
