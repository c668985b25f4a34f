"""TCP backend: several parallel streams per peer, large transfers sliced across them."""

from services.transfer.backends.contract import Availability
from services.transfer.backends.tcp.receiver import TcpReceiver
from services.transfer.backends.tcp.sender import TcpSender


def available() -> Availability:
    return Availability(True)


__all__ = ["TcpReceiver", "TcpSender", "available"]
