"""Same-host shared-memory backend, and the RDMA backend's code path on fake verbs."""

import importlib.util
import os

import pytest

from services.transfer.backends import Opcode, Poll, Region, Request, TransportError
from services.transfer.backends.rdma import RdmaReceiver, RdmaSender, verbs
from services.transfer.batch_api import TransferEngine, TransferRequest
from tests.unit import fake_verbs

WAIT = 30.0


def test_shm_write_read_and_checksum_between_two_engines():
    a, b = TransferEngine("shm"), TransferEngine("shm")
    try:
        ra, va = a.allocate_managed_buffer(1 << 20)
        rb, vb = b.allocate_managed_buffer(1 << 20)
        data = os.urandom(1 << 19)
        va[: len(data)] = data
        a.transfer_sync(
            [TransferRequest(Opcode.WRITE, ra, 0, len(data), b.segment, rb, 4096, checksum=True)],
            timeout=WAIT,
        )
        assert vb[4096 : 4096 + len(data)] == data
        vb[:16] = b"0123456789abcdef"
        a.transfer_sync([TransferRequest(Opcode.READ, ra, 100, 16, b.segment, rb, 0)], timeout=WAIT)
        assert va[100:116] == b"0123456789abcdef"
        with pytest.raises(TransportError) as e:
            a.transfer_sync(
                [TransferRequest(Opcode.WRITE, ra, 0, 16, b.segment, rb, (1 << 20) - 8)],
                timeout=WAIT,
            )
        assert e.value.code == "refused"
        with pytest.raises(TransportError) as e:
            a.transfer_sync(
                [TransferRequest(Opcode.WRITE, ra, 0, 16, "shm://nobody", 1, 0)], timeout=WAIT
            )
        assert e.value.code == "unreachable"
        assert a.open_batches == 0
    finally:
        a.close()
        b.close()


def test_a_big_shm_copy_split_across_helper_threads_lands_exactly(monkeypatch):
    from services.transfer.backends import shm

    a = TransferEngine("shm", sender_opts={"split_min": 1 << 16, "split_threads": 2})
    b = TransferEngine("shm")
    try:
        ra, va = a.allocate_managed_buffer(1 << 20)
        rb, vb = b.allocate_managed_buffer(1 << 20)
        n = 3 * 4096 * 7 + 123  # not a whole number of pages: a short last part
        data = os.urandom(n)
        va[:n] = data
        parts: list[int] = []
        real = shm.copy
        monkeypatch.setattr(shm, "copy", lambda d, s_: (parts.append(len(d)), real(d, s_)))
        req = TransferRequest(Opcode.WRITE, ra, 0, n, b.segment, rb, 8, checksum=True)
        a.transfer_sync([req], timeout=WAIT)
        assert vb[8 : 8 + n] == data and vb[:8] == bytes(8) and vb[8 + n : 16 + n] == bytes(8)
        # pages per part: this thread's (the first), two helpers' (the last one short)
        assert sorted(parts) == [n - 2 * 32768, 32768, 32768]
        parts.clear()
        a.transfer_sync([TransferRequest(Opcode.WRITE, ra, 0, 4096, b.segment, rb, 0)], WAIT)
        assert parts == [4096]  # below split_min: one copy

        # a helper's failure fails the request, and the helpers go on serving
        def broken(d, s_):
            if len(d) == n - 2 * 32768:  # the last part: a helper's
                raise MemoryError("helper")
            real(d, s_)

        monkeypatch.setattr(shm, "copy", broken)
        with pytest.raises(TransportError) as e:
            a.transfer_sync([req], timeout=WAIT)
        assert e.value.code == "internal" and "helper" in str(e.value)
        monkeypatch.setattr(shm, "copy", real)
        vb[:] = bytes(1 << 20)
        a.transfer_sync([req], timeout=WAIT)
        assert vb[8 : 8 + n] == data
    finally:
        a.close()
        b.close()


def test_rdma_discovery_skips_cleanly_without_a_device():
    ok, names = verbs.discover(fake_verbs.make(devices=()))
    assert (ok.ok, names) == (False, []) and "no RDMA device" in ok.reason
    ok, names = verbs.discover(fake_verbs.make())
    assert (ok.ok, names) == (True, ["fake_mlx5_0"])
    with pytest.raises(TransportError) as e:
        RdmaSender(v=fake_verbs.make(devices=()))
    assert e.value.code == "unavailable"
    # This machine: available exactly when pyverbs imports and the kernel lists an RDMA
    # device (checked here without pyverbs); otherwise a reason, never an exception.
    real, names = verbs.discover()
    sysfs = "/sys/class/infiniband"
    device = os.path.isdir(sysfs) and bool(os.listdir(sysfs))
    assert real.ok == (device and importlib.util.find_spec("pyverbs") is not None), real.reason
    assert bool(names) == real.ok and (real.ok or real.reason)


@pytest.fixture
def rdma():
    v = fake_verbs.make()
    rx = RdmaReceiver(v=v)
    remote = bytearray(1 << 16)
    rx.expose(Region(id=3, buf=memoryview(remote)))
    tx = RdmaSender(v=v, paths=2, slice_bytes=4096)
    local = bytearray(os.urandom(1 << 16))
    tx.register(Region(id=1, buf=memoryview(local)))
    yield v, rx, tx, remote, local
    tx.close()
    rx.close()


def test_rdma_write_and_read_land_exactly_over_both_paths(rdma):
    v, rx, tx, remote, local = rdma
    t = tx.submit(Request(Opcode.WRITE, memoryview(local)[:20000], rx.address, 3, 100))
    assert t.wait(WAIT) == Poll.SUCCESS and t.transferred == 20000
    assert remote[100:20100] == local[:20000]
    qps = {qp for qp, _, _ in v.state.posted}
    assert len(qps) == 2 and [n for _, _, n in v.state.posted] == [4096] * 4 + [3616]
    remote[:8] = b"RDMAREAD"
    t = tx.submit(Request(Opcode.READ, memoryview(local)[8:16], rx.address, 3, 0))
    assert t.wait(WAIT) == Poll.SUCCESS and local[8:16] == b"RDMAREAD"


def test_rdma_broken_path_is_retried_and_all_broken_fails(rdma):
    v, rx, tx, remote, local = rdma
    tx.submit(Request(Opcode.WRITE, memoryview(local)[:1], rx.address, 3, 0)).wait(WAIT)
    first_qp = v.state.posted[0][0]
    v.state.down.add(first_qp)
    t = tx.submit(Request(Opcode.WRITE, memoryview(local)[:8192], rx.address, 3, 0))
    assert t.wait(WAIT) == Poll.SUCCESS and remote[:8192] == local[:8192]
    v.state.down.update(qp for qp, _, _ in v.state.posted)
    t = tx.submit(Request(Opcode.WRITE, memoryview(local)[:8192], rx.address, 3, 0))
    assert t.wait(WAIT) == Poll.FAILED and t.error.code == "broken"


def test_rdma_refuses_unregistered_memory_checksums_and_bad_spans(rdma):
    v, rx, tx, remote, local = rdma
    cases = [
        (Request(Opcode.WRITE, memoryview(bytearray(8)), rx.address, 3, 0), "bad_request"),
        (
            Request(Opcode.WRITE, memoryview(local)[:8], rx.address, 3, 0, checksum=True),
            "bad_request",
        ),
        (Request(Opcode.WRITE, memoryview(local)[:8], rx.address, 9, 0), "refused"),
        (Request(Opcode.WRITE, memoryview(local)[:8], rx.address, 3, 1 << 16), "refused"),
        (Request(Opcode.WRITE, memoryview(local)[:8], "rdma://127.0.0.1:1", 3, 0), "unreachable"),
    ]
    for req, code in cases:
        t = tx.submit(req)
        assert t.wait(WAIT) == Poll.FAILED and t.error.code == code, req


def test_what_killed_stores_left_in_dev_shm_is_swept_and_nothing_live(tmp_path):
    """A store killed with SIGKILL leaves its descriptor and its local socket (its arena
    is unlinked by its resource tracker): a store starting removes those, judged by
    whether their segments still exist, never a live store's, nor what it cannot read."""
    import json

    from services.transfer.backends.shm import sweep_stale

    d = tmp_path
    (d / "perigee_11_aa").write_bytes(b"")  # a live store's arena
    files = {
        "perigee-seg-11-aa.json": {"0": {"name": "perigee_11_aa", "offset": 0, "size": 8}},
        "perigee-seg-12-bb.json": {"0": {"name": "/perigee_12_bb", "offset": 0, "size": 8}},
        "perigee-seg-13-cc.json": {},  # a receiver with nothing exposed yet
    }
    for name, desc in files.items():
        (d / name).write_text(json.dumps(desc))
    (d / "perigee-seg-14-dd.json").write_text("{not json")  # being written
    (d / "perigee_11_aa.ctl").write_bytes(b"")
    (d / "perigee_12_bb.ctl").write_bytes(b"")
    (d / "other.ctl").write_bytes(b"")
    assert sweep_stale(str(d)) == 2
    left = sorted(p.name for p in d.iterdir())
    assert left == [
        "other.ctl",
        "perigee-seg-11-aa.json",
        "perigee-seg-13-cc.json",
        "perigee-seg-14-dd.json",
        "perigee_11_aa",
        "perigee_11_aa.ctl",
    ]
    assert sweep_stale(str(d / "missing")) == 0
