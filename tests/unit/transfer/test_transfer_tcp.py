"""TCP backend on loopback: bytes land exactly, broken streams are retried, failures end.

Completion is awaited on tickets (threading events) with generous timeouts; nothing
asserts on time.
"""

import os
import socket

import pytest

from perigee.natsd import free_port
from services.transfer.backends import Opcode, Poll, Region, Request
from services.transfer.backends.tcp import TcpReceiver, TcpSender
from services.transfer.backends.tcp.frames import HELLO, NO_TOKEN, REP, REQ, Status, recv_exact

WAIT = 30.0


@pytest.fixture
def rx():
    r = TcpReceiver()
    yield r
    r.close()


def expose(rx: TcpReceiver, n: int, rid: int = 1) -> bytearray:
    buf = bytearray(n)
    rx.expose(Region(id=rid, buf=memoryview(buf)))
    return buf


def test_write_and_read_sliced_over_four_streams(rx):
    remote = expose(rx, 3 << 20)
    tx = TcpSender(streams=4, min_slice=64 << 10, max_slice=256 << 10, inline_max=0)
    try:
        data = os.urandom(2 << 20)
        t = tx.submit(Request(Opcode.WRITE, memoryview(data), rx.address, 1, 1000))
        assert t.wait(WAIT) == Poll.SUCCESS and t.transferred == len(data)
        assert remote[1000 : 1000 + len(data)] == data
        back = bytearray(1 << 20)
        t = tx.submit(Request(Opcode.READ, memoryview(back), rx.address, 1, 1000, checksum=True))
        assert t.wait(WAIT) == Poll.SUCCESS
        assert back == data[: 1 << 20]
        assert rx.counters["streams"] == 4 and rx.counters["writes"] == 8
        assert tx.endpoints == [rx.address]
    finally:
        tx.close()


def test_checksummed_write_lands_and_a_bad_checksum_is_rejected_untouched(rx):
    remote = expose(rx, 64)
    tx = TcpSender(streams=1)
    try:
        t = tx.submit(Request(Opcode.WRITE, memoryview(b"a" * 16), rx.address, 1, 0, checksum=True))
        assert t.wait(WAIT) == Poll.SUCCESS and remote[:16] == b"a" * 16
    finally:
        tx.close()
    host, port = rx.address[6:].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=WAIT) as s:
        s.sendall(HELLO + REQ.pack(1, 1, 0, 1, 7, 0, 4, 12345, NO_TOKEN) + b"zzzz")
        hdr = memoryview(bytearray(REP.size))
        recv_exact(s, hdr)
        assert REP.unpack(hdr)[:3] == (Status.CHECKSUM, 0, 7)
    assert remote[:16] == b"a" * 16 and rx.counters["checksum_mismatches"] == 1


def test_refused_span_keeps_the_stream_in_step(rx):
    remote = expose(rx, 8)
    tx = TcpSender(streams=1)
    try:
        bad = tx.submit(Request(Opcode.WRITE, memoryview(b"x" * 6), rx.address, 1, 4))
        good = tx.submit(Request(Opcode.WRITE, memoryview(b"y" * 4), rx.address, 1, 0))
        assert bad.wait(WAIT) == Poll.FAILED and bad.error.code == "refused"
        assert "outside region 1" in bad.error.message
        assert good.wait(WAIT) == Poll.SUCCESS and remote == b"yyyy" + bytes(4)
    finally:
        tx.close()


def test_dead_peer_is_unreachable():
    tx = TcpSender(streams=3)
    try:
        t = tx.submit(
            Request(Opcode.WRITE, memoryview(b"x" * 1024), f"tcp://127.0.0.1:{free_port()}", 1, 0)
        )
        assert t.wait(WAIT) == Poll.FAILED
        assert t.error.code == "unreachable" and "all 3 streams" in t.error.message
    finally:
        tx.close()


class FlakyReceiver(TcpReceiver):
    """Drops the first ``drop`` streams it accepts right after their hello."""

    def __init__(self, drop: int) -> None:
        self.drop = drop
        super().__init__()

    def _serve(self, conn: socket.socket) -> None:
        with self._lock:
            kill = self.drop > 0
            self.drop -= 1
        if kill:
            recv_exact(conn, memoryview(bytearray(len(HELLO))))
            conn.close()
            return
        super()._serve(conn)


def test_a_broken_stream_hands_its_slices_to_the_others():
    rx = FlakyReceiver(drop=1)
    remote = expose(rx, 1 << 20)
    tx = TcpSender(streams=2, min_slice=64 << 10, max_slice=64 << 10)
    try:
        data = os.urandom(1 << 20)
        t = tx.submit(Request(Opcode.WRITE, memoryview(data), rx.address, 1, 0))
        assert t.wait(WAIT) == Poll.SUCCESS
        assert remote == data
    finally:
        tx.close()
        rx.close()


def test_every_stream_broken_fails_the_request_then_a_new_attempt_reconnects():
    rx = FlakyReceiver(drop=2)
    remote = expose(rx, 4096)
    tx = TcpSender(streams=2, min_slice=1024, max_slice=1024)
    try:
        t = tx.submit(Request(Opcode.WRITE, memoryview(b"q" * 4096), rx.address, 1, 0))
        assert t.wait(WAIT) == Poll.FAILED and t.error.code == "broken"
        t = tx.submit(Request(Opcode.WRITE, memoryview(b"r" * 4096), rx.address, 1, 0))
        assert t.wait(WAIT) == Poll.SUCCESS and remote == b"r" * 4096
    finally:
        tx.close()
        rx.close()


def test_endpoint_pool_is_capped():
    rxs = [TcpReceiver() for _ in range(3)]
    tx = TcpSender(streams=1, max_endpoints=2)
    try:
        for r in rxs:
            expose(r, 16)
            assert (
                tx.submit(Request(Opcode.WRITE, memoryview(b"1"), r.address, 1, 0)).wait(WAIT)
                == Poll.SUCCESS
            )
        assert tx.endpoints == [rxs[1].address, rxs[2].address]
        assert tx.endpoint_evictions() == 1
    finally:
        tx.close()
        for r in rxs:
            r.close()


def test_bad_target_and_closed_sender():
    tx = TcpSender()
    t = tx.submit(Request(Opcode.WRITE, memoryview(b"1"), "udp://x", 1, 0))
    assert t.poll() == Poll.FAILED and t.error.code == "bad_request"
    tx.close()
    t = tx.submit(Request(Opcode.WRITE, memoryview(b"1"), "tcp://127.0.0.1:1", 1, 0))
    assert t.poll() == Poll.FAILED and t.error.code == "closed"


async def test_engine_batch_to_a_dead_peer_ends_failed_and_frees():
    from services.transfer.batch_api import TransferEngine, TransferRequest

    a, b = TransferEngine("tcp"), TransferEngine("tcp")
    try:
        src = a.register_local_memory(bytearray(b"z" * 4096))
        dst_buf = bytearray(4096)
        dst = b.register_local_memory(dst_buf)
        bid = a.allocate_batch_id(2)
        a.submit_transfer(
            bid,
            [
                TransferRequest(Opcode.WRITE, src, 0, 4096, b.segment, dst, 0, checksum=True),
                TransferRequest(
                    Opcode.WRITE, src, 0, 4096, f"tcp://127.0.0.1:{free_port()}", dst, 0
                ),
            ],
        )
        statuses = await a.wait_batch(bid, timeout=WAIT)
        assert [s.state for s in statuses] == [Poll.SUCCESS, Poll.FAILED]
        assert statuses[1].code == "unreachable" and dst_buf == b"z" * 4096
        assert a.free_batch_id(bid) == 0 and a.open_batches == 0
    finally:
        a.close()
        b.close()


# ------------------------------------------------------------- inline sends, lazy replies


def connected(tx: TcpSender, rx: TcpReceiver) -> None:
    """Open every stream of the endpoint: the first request to a target is queued to the
    streams' threads (they connect), one slice per stream; once it ended all are up."""
    data = memoryview(bytes(tx.streams * tx.inline_slice))
    assert tx.submit(Request(Opcode.WRITE, data, rx.address, 1, 0)).wait(WAIT) == Poll.SUCCESS


def record_readers(monkeypatch) -> list[int]:
    """Thread ids that read each reply."""
    import threading

    from services.transfer.backends.tcp.stream import Stream

    who: list[int] = []
    orig = Stream._reply

    def spy(self, sock, hdr):
        orig(self, sock, hdr)
        who.append(threading.get_ident())

    monkeypatch.setattr(Stream, "_reply", spy)
    return who


def test_small_request_is_sent_inline_and_its_replies_read_by_the_waiter(rx, monkeypatch):
    import threading

    remote = expose(rx, 4 << 20)
    tx = TcpSender(streams=4, inline_max=4 << 20, inline_slice=256 << 10)
    try:
        connected(tx, rx)
        who = record_readers(monkeypatch)
        writes = rx.counters["writes"]
        data = os.urandom((1 << 20) + 5)
        t = tx.submit(Request(Opcode.WRITE, memoryview(data), rx.address, 1, 7))
        assert t.wait(WAIT) == Poll.SUCCESS and t.transferred == len(data)
        assert remote[7 : 7 + len(data)] == data
        assert rx.counters["writes"] - writes == 5  # 4 slices of 256 KiB and 5 bytes
        assert who == [threading.get_ident()] * 5
        back = bytearray(len(data))
        t = tx.submit(Request(Opcode.READ, memoryview(back), rx.address, 1, 7, checksum=True))
        assert t.wait(WAIT) == Poll.SUCCESS and back == data
        assert who == [threading.get_ident()] * 10
    finally:
        tx.close()


def test_an_inline_request_observed_by_callback_is_finished_by_the_stream_thread(rx, monkeypatch):
    import threading

    remote = expose(rx, 1 << 20)
    tx = TcpSender(streams=2)
    try:
        connected(tx, rx)
        who = record_readers(monkeypatch)
        done = threading.Event()
        t = tx.submit(Request(Opcode.WRITE, memoryview(b"c" * 4096), rx.address, 1, 0))
        t.on_done(lambda _t: done.set())
        assert done.wait(WAIT) and t.poll() == Poll.SUCCESS and remote[:4096] == b"c" * 4096
        assert len(who) == 1 and who[0] != threading.get_ident()
    finally:
        tx.close()


def test_an_unobserved_reply_is_read_by_the_next_waiter_on_the_stream(rx):
    remote = expose(rx, 1 << 20)
    tx = TcpSender(streams=1)
    try:
        connected(tx, rx)
        first = tx.submit(Request(Opcode.WRITE, memoryview(b"a" * 8), rx.address, 1, 0))
        second = tx.submit(Request(Opcode.WRITE, memoryview(b"b" * 8), rx.address, 1, 8))
        assert not first.ended  # nobody looked: its reply waits in the socket
        assert second.wait(WAIT) == Poll.SUCCESS
        assert first.ended and first.state == Poll.SUCCESS  # replies come in order
        assert remote[:16] == b"a" * 8 + b"b" * 8
    finally:
        tx.close()


class GatedReceiver(TcpReceiver):
    """Reads each request's header and payload, then answers only once ``gate`` is set."""

    def __init__(self) -> None:
        import threading

        self.gate = threading.Event()
        super().__init__()

    def _serve(self, conn: socket.socket) -> None:
        recv_exact(conn, memoryview(bytearray(len(HELLO))))
        hdr = memoryview(bytearray(REQ.size))
        try:
            while True:
                recv_exact(conn, hdr)
                _, _, _, _, seq, _, length, _, _ = REQ.unpack(hdr)
                recv_exact(conn, memoryview(bytearray(length)))
                if not self.gate.wait(WAIT):
                    return
                conn.sendall(REP.pack(Status.OK, 0, seq, length))
        except (OSError, ConnectionError):
            pass
        finally:
            conn.close()


def test_a_wait_shorter_than_the_reply_returns_unfinished_and_a_later_wait_ends_it():
    rx = GatedReceiver()
    tx = TcpSender(streams=1)
    try:
        rx.gate.set()
        connected(tx, rx)
        rx.gate.clear()
        t = tx.submit(Request(Opcode.WRITE, memoryview(b"g" * 64), rx.address, 1, 0))
        assert t.wait(0.05) == Poll.TRANSFERRING and not t.ended
        rx.gate.set()
        assert t.wait(WAIT) == Poll.SUCCESS
    finally:
        tx.close()
        rx.close()


def test_a_peer_that_never_replies_breaks_the_stream_after_the_io_timeout():
    rx = GatedReceiver()
    tx = TcpSender(streams=1, io_timeout_s=0.2)
    try:
        rx.gate.set()
        connected(tx, rx)
        rx.gate.clear()
        t = tx.submit(Request(Opcode.WRITE, memoryview(b"s" * 64), rx.address, 1, 0))
        assert t.wait(WAIT) == Poll.FAILED
        assert t.error.code == "broken" and "timed out" in t.error.message
    finally:
        rx.gate.set()
        tx.close()
        rx.close()


def test_unobserved_reads_beyond_the_peer_buffers_do_not_stall_later_writes(rx):
    """40 MiB of READ replies nobody waits for, then 24 MiB of WRITEs on the same stream:
    without the stream's thread draining the READ payloads the peer would stop reading
    requests and the WRITEs would block in ``submit``."""
    remote = expose(rx, 4 << 20)
    tx = TcpSender(streams=1)
    try:
        connected(tx, rx)
        remote[:] = os.urandom(4 << 20)
        orig = bytes(remote)
        backs = [bytearray(1 << 20) for _ in range(40)]
        reads = [
            tx.submit(Request(Opcode.READ, memoryview(b), rx.address, 1, (i % 4) << 20))
            for i, b in enumerate(backs)
        ]
        data = os.urandom(4 << 20)
        writes = [
            tx.submit(Request(Opcode.WRITE, memoryview(data), rx.address, 1, 0)) for _ in range(6)
        ]
        assert [t.wait(WAIT) for t in writes] == [Poll.SUCCESS] * 6
        assert [t.wait(WAIT) for t in reads] == [Poll.SUCCESS] * 40
        assert all(b == orig[(i % 4) << 20 : ((i % 4) + 1) << 20] for i, b in enumerate(backs))
        assert remote == data
    finally:
        tx.close()
