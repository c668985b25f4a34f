"""Listing 1's batch API over the fake backend: states, retries, failures, batch rules."""

import pytest

from services.transfer.backends import Opcode, Poll
from services.transfer.batch_api import TransferApiError, TransferEngine, TransferRequest
from tests.unit.fake_transport import FakeNetwork, FakeReceiver, FakeSender, available


def make(
    manual: bool = False, paths: int = 2
) -> tuple[FakeNetwork, TransferEngine, TransferEngine]:
    net = FakeNetwork()
    engines = []
    for name in ("a", "b"):
        e = TransferEngine(
            "fake", serve=False, sender_opts={"network": net, "paths": paths, "manual": manual}
        )
        e.receiver = FakeReceiver(net, name)
        engines.append(e)
    return net, engines[0], engines[1]


def regions(
    a: TransferEngine, b: TransferEngine, n: int = 16
) -> tuple[int, bytearray, int, bytearray]:
    src, dst = bytearray(range(n)), bytearray(n)
    return a.register_local_memory(src), src, b.register_local_memory(dst), dst


def test_write_goes_pending_transferring_success_slice_by_slice():
    net, a, b = make(manual=True)
    ra, src, rb, dst = regions(a, b)
    bid = a.allocate_batch_id(2)
    assert a.submit_transfer(bid, [TransferRequest(Opcode.WRITE, ra, 0, 8, b.segment, rb, 4)]) == 0
    assert a.get_transfer_status(bid, 0).state == Poll.PENDING
    a.sender.pump(1)
    s = a.get_transfer_status(bid, 0)
    assert (s.state, s.transferred_bytes) == (Poll.TRANSFERRING, 4)
    with pytest.raises(TransferApiError) as e:
        a.free_batch_id(bid)
    assert e.value.code == "busy"
    a.sender.pump()
    assert a.get_transfer_status(bid, 0).state == Poll.SUCCESS
    assert dst == bytes(4) + bytes(range(8)) + bytes(4)
    assert net.log == [("fake://b", 0, 4), ("fake://b", 1, 4)]
    assert a.free_batch_id(bid) == 0 and a.open_batches == 0


def test_read_and_batch_capacity_and_bad_entries():
    _, a, b = make()
    ra, src, rb, dst = regions(a, b)
    dst[:] = b"x" * 16
    bid = a.allocate_batch_id(1)
    a.submit_transfer(bid, [TransferRequest(Opcode.READ, ra, 2, 3, b.segment, rb, 0)])
    assert bytes(src[:6]) == bytes([0, 1]) + b"xxx" + bytes([5])
    with pytest.raises(TransferApiError) as e:
        a.submit_transfer(bid, [TransferRequest(Opcode.READ, ra, 0, 1, b.segment, rb, 0)])
    assert e.value.code == "batch_full"
    bid2 = a.allocate_batch_id(4)
    for bad in (
        TransferRequest(Opcode.WRITE, 99, 0, 1, b.segment, rb, 0),
        TransferRequest(Opcode.WRITE, ra, 10, 7, b.segment, rb, 0),
    ):
        with pytest.raises(TransferApiError) as e:
            a.submit_transfer(bid2, [bad])
        assert e.value.code == "bad_request"
    assert a.batch_status(bid2) == []
    with pytest.raises(TransferApiError):
        a.get_transfer_status(77, 0)
    with pytest.raises(TransferApiError):
        a.allocate_batch_id(0)


def test_a_broken_path_is_retried_on_another_and_all_broken_fails_and_frees():
    net, a, b = make(paths=3)
    ra, src, rb, dst = regions(a, b)
    net.broken = {0, 2}
    bid = a.allocate_batch_id(2)
    a.submit_transfer(bid, [TransferRequest(Opcode.WRITE, ra, 0, 8, b.segment, rb, 0)])
    assert a.get_transfer_status(bid, 0).state == Poll.SUCCESS
    assert [path for _, path, _ in net.log] == [1, 1]
    net.broken = {0, 1, 2}
    a.submit_transfer(bid, [TransferRequest(Opcode.WRITE, ra, 0, 8, b.segment, rb, 8)])
    s = a.get_transfer_status(bid, 1)
    assert (s.state, s.code) == (Poll.FAILED, "broken")
    assert "all 3 paths" in s.error
    assert a.free_batch_id(bid) == 0


def test_dead_peer_fails_and_checksum_mismatch_is_rejected_untouched():
    net, a, b = make()
    ra, src, rb, dst = regions(a, b)
    bid = a.allocate_batch_id(3)
    a.submit_transfer(bid, [TransferRequest(Opcode.WRITE, ra, 0, 4, "fake://gone", rb, 0)])
    assert (a.get_transfer_status(bid, 0).state, a.get_transfer_status(bid, 0).code) == (
        Poll.FAILED,
        "unreachable",
    )
    net.corrupt = {"b"}
    a.submit_transfer(
        bid, [TransferRequest(Opcode.WRITE, ra, 1, 4, b.segment, rb, 0, checksum=True)]
    )
    s = a.get_transfer_status(bid, 1)
    assert (s.state, s.code) == (Poll.FAILED, "checksum")
    assert dst == bytearray(16)
    a.submit_transfer(bid, [TransferRequest(Opcode.WRITE, ra, 1, 4, b.segment, rb, 0)])
    assert a.get_transfer_status(bid, 2).state == Poll.SUCCESS
    assert dst[:4] == bytes([1 ^ 0xFF, 2, 3, 4])  # unchecked: the corruption goes through
    assert a.free_batch_id(bid) == 0


def test_out_of_range_remote_span_is_refused():
    _, a, b = make()
    ra, _, rb, _ = regions(a, b)
    bid = a.allocate_batch_id(1)
    a.submit_transfer(bid, [TransferRequest(Opcode.WRITE, ra, 0, 8, b.segment, rb, 12)])
    s = a.get_transfer_status(bid, 0)
    assert (s.state, s.code) == (Poll.FAILED, "refused")


async def test_wait_batch_completes_from_another_thread():
    import threading

    _, a, b = make(manual=True)
    ra, src, rb, dst = regions(a, b)
    bid = a.allocate_batch_id(2)
    a.submit_transfer(
        bid,
        [
            TransferRequest(Opcode.WRITE, ra, 0, 8, b.segment, rb, 0),
            TransferRequest(Opcode.WRITE, ra, 8, 8, b.segment, rb, 8),
        ],
    )
    threading.Thread(target=a.sender.pump).start()
    statuses = await a.wait_batch(bid, timeout=10)
    assert [s.state for s in statuses] == [Poll.SUCCESS, Poll.SUCCESS]
    assert dst == src


def test_unavailable_backend_is_refused_with_its_reason():
    from services.transfer.backends import TransportError, availability

    assert availability("nope").ok is False
    with pytest.raises(TransportError) as e:
        TransferEngine("nope")
    assert e.value.code == "unavailable"


def test_registered_backend_is_listed_and_cannot_shadow_a_built_in():
    from services.transfer import backends

    assert "fake" in backends.backends() and "fake" not in backends.BACKENDS
    with pytest.raises(ValueError):
        backends.register("tcp", available, FakeSender, FakeReceiver)
    built_in = backends.make_sender("tcp")
    try:
        assert built_in.scheme == "tcp"
    finally:
        built_in.close()


def test_fake_sender_close_fails_pending():
    net = FakeNetwork()
    FakeReceiver(net, "b")
    s = FakeSender(net, manual=True)
    from services.transfer.backends import Request

    t = s.submit(Request(Opcode.WRITE, memoryview(bytearray(4)), "fake://b", 1, 0))
    s.close()
    assert t.poll() == Poll.FAILED and t.error.code == "closed"
