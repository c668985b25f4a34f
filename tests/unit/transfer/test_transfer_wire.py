"""Arena and data-plane frames, in process."""

import os

import pytest

from services.store.arena import Arena, ArenaError
from services.transfer import wire


@pytest.fixture
def arena():
    a = Arena.create(capacity=4, block_bytes=16)
    yield a
    a.close()
    a.unlink()


def test_attach_sees_the_creators_bytes_and_survives_unlink(arena):
    other = Arena.attach(arena.name, 4, 16)
    arena.slot(2)[:] = bytes(range(16))
    assert bytes(other.slot(2)) == bytes(range(16))
    other.span(3, 4, 4)[:] = b"abcd"
    assert bytes(arena.slot(3)[4:8]) == b"abcd"
    other.close()
    assert os.path.exists(f"/dev/shm/{arena.name}") or not os.path.isdir("/dev/shm")


def test_attach_refuses_missing_or_small_segments(arena):
    with pytest.raises(ArenaError):
        Arena.attach("perigee_no_such_segment", 4, 16)
    with pytest.raises(ArenaError):
        Arena.attach(arena.name, 5, 16)


def test_slot_and_span_bounds(arena):
    with pytest.raises(IndexError):
        arena.slot(4)
    with pytest.raises(IndexError):
        arena.span(0, 8, 9)
    with pytest.raises(IndexError):
        arena.spans([0, -1], 0, 16)


def test_spans_merge_consecutive_whole_slots_only(arena):
    whole = arena.spans([0, 1, 3], 0, 16)
    assert [len(s) for s in whole] == [32, 16]
    parts = arena.spans([0, 1], 4, 8)
    assert [len(s) for s in parts] == [8, 8]


def test_scatter_copies_across_frame_boundaries(arena):
    payload = [memoryview(b"0123456789"), memoryview(b"abcdef")]
    n = wire.scatter(payload, arena.spans([1, 3], 0, 8))
    assert n == 16
    assert bytes(arena.slot(1)[:8]) == b"01234567" and bytes(arena.slot(3)[:8]) == b"89abcdef"
    with pytest.raises(wire.WireError):
        wire.scatter([memoryview(b"short")], arena.spans([0], 0, 16))


def test_frames_roundtrip_and_bad_frames_keep_the_id():
    h = wire.Open(id=7, tx="t", epoch=1, slots=[1, 2], offset=0, length=4, write=True)
    assert wire.parse(wire.frames(h)) == (wire.Kind.OPEN, h)
    g = wire.Granted(id=7, grant=3, segments={"tcp": "tcp://h:1"}, regions={"tcp": 1}, ttl_s=2.0)
    assert wire.parse(wire.frames(g)) == (wire.Kind.GRANTED, g)
    with pytest.raises(wire.WireError) as e:  # coordination only: no payload frames
        wire.parse([*wire.frames(h), b"kv bytes"])
    assert e.value.req_id == 7 and e.value.code == "bad_frame"
    bad_header = wire.frames(wire.Ok(id=9))
    bad_header[0] = bytes([wire.Kind.OPEN])  # an OK header under an OPEN kind
    with pytest.raises(wire.WireError) as e:
        wire.parse(bad_header)
    assert e.value.req_id == 9 and e.value.code == "bad_frame"
    for junk in ([b"\x03"], [b"\x99", b"x"], [b"xx", b"y"], [b"\x03", b"\xc1"]):
        with pytest.raises(wire.WireError):
            wire.parse(junk)
