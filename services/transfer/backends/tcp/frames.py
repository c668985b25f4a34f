"""TCP transfer frames: fixed little-endian headers, payload bytes follow raw.

A stream opens with a HELLO (``services.transfer.data_auth.hello``: magic, the sender's
session id, a MAC under the run's data key when the target has one).

Request  (initiator -> target): op u8, flags u8, pad u16, region u32, seq u64,
         offset u64, length u64, crc u32 (of the payload when FLAG_CRC), token 16 bytes
         (the capability of the grant the bytes move under; zeros when none) = 52 bytes
         WRITE: ``length`` payload bytes follow.
Reply    (target -> initiator): status u8, pad u8*3, crc u32, seq u64, length u64 = 24 bytes
         READ with status OK: ``length`` payload bytes follow.

A stream carries requests one after the other and the target answers them in order,
so the initiator matches replies first-in first-out (``seq`` is checked anyway).
"""

import socket
import struct
from enum import IntEnum

from services.transfer import data_auth

REQ = struct.Struct("<BBHIQQQI16s")
REP = struct.Struct("<BxxxIQQ")
FLAG_CRC = 1
# A HELLO without a key (zero session, no MAC): what a receiver without a key accepts.
HELLO = data_auth.HELLO_MAGIC + bytes(data_auth.SESSION_BYTES + data_auth.MAC_BYTES)
TOKEN_BYTES = 16
NO_TOKEN = bytes(TOKEN_BYTES)
MAX_REFUSAL = 4096  # a REFUSED reply's message is at most this long (else out of step)


class Status(IntEnum):
    """A TCP transfer reply's verdict on a request."""

    OK = 0
    CHECKSUM = 1
    REFUSED = 2


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock`` (raises ConnectionError on EOF)."""
    got = 0
    n = len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed the stream")
        got += k


def discard(sock: socket.socket, n: int, scratch: memoryview) -> None:
    while n > 0:
        k = min(n, len(scratch))
        recv_exact(sock, scratch[:k])
        n -= k


def tune(sock: socket.socket, bufsize: int = 4 << 20) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, bufsize)
        except OSError:
            pass


def set_io_timeout(sock: socket.socket, seconds: float | None) -> None:
    """Blocking socket whose every send/recv gives up after ``seconds`` without progress
    (``BlockingIOError``), enforced by the kernel (SO_SNDTIMEO / SO_RCVTIMEO): Python's
    own socket timeout would add a poll() before every send and recv."""
    sock.settimeout(None)
    if not seconds:
        return
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
