"""SIEVE endpoint pool and request slicing, by hand with exact orders."""

import pytest

from services.transfer.backends import slicing
from services.transfer.backends.sieve import SievePool


def test_sieve_evicts_the_first_unvisited_from_the_hand():
    pool: SievePool[str, int] = SievePool(3)
    assert pool.put("a", 1) == [] and pool.put("b", 2) == [] and pool.put("c", 3) == []
    assert pool.get("a") == 1  # a visited
    assert pool.put("d", 4) == [("b", 2)]  # hand passes a (clearing it), evicts b
    assert list(pool) == ["a", "c", "d"]
    assert pool.visited("a") is False
    assert pool.get("c") == 3
    assert pool.put("e", 5) == [("d", 4)]  # hand continues at d (c was left behind it)
    assert list(pool) == ["a", "c", "e"] and pool.evictions == 2


def test_sieve_hit_moves_nothing_and_one_off_keys_go_first():
    pool: SievePool[str, int] = SievePool(2)
    pool.put("hot", 0)
    pool.get("hot")
    for i in range(5):
        pool.put(f"once{i}", i)
        pool.get("hot")
    assert list(pool) == ["hot", "once4"]


def test_sieve_skips_busy_endpoints_unless_all_are_busy():
    busy = {"a"}
    pool: SievePool[str, str] = SievePool(2, busy=lambda v: v in busy)
    pool.put("a", "a")
    pool.put("b", "b")
    assert pool.put("c", "c") == [("b", "b")]
    busy.update({"c"})
    evicted = pool.put("d", "d")
    assert len(evicted) == 1 and len(pool) == 2  # the cap holds even when all are busy


def test_sieve_remove_keeps_the_hand_in_place():
    pool: SievePool[str, int] = SievePool(3)
    for k in "abc":
        pool.put(k, 0)
    assert pool.remove("b") == 0 and pool.remove("b") is None
    assert list(pool) == ["a", "c"] and "b" not in pool
    with pytest.raises(ValueError):
        SievePool(0)


def test_slicing_spreads_evenly_within_bounds_round_robin():
    assert slicing.plan(10, 4, min_bytes=2, max_bytes=4) == [
        slicing.Slice(0, 3, 0),
        slicing.Slice(3, 3, 1),
        slicing.Slice(6, 3, 2),
        slicing.Slice(9, 1, 3),
    ]
    assert slicing.plan(10, 2, start=1, min_bytes=1, max_bytes=3) == [
        slicing.Slice(0, 3, 1),
        slicing.Slice(3, 3, 0),
        slicing.Slice(6, 3, 1),
        slicing.Slice(9, 1, 0),
    ]
    # over paths * max_bytes: every path gets the same slices (not 3, 3, 3, 3, 3, 1)
    assert slicing.plan(16, 4, min_bytes=1, max_bytes=3) == [
        slicing.Slice(o, 2, k % 4) for k, o in enumerate(range(0, 16, 2))
    ]
    assert slicing.plan(5, 4, min_bytes=64) == [slicing.Slice(0, 5, 0)]
    assert slicing.plan(0, 4, start=6) == [slicing.Slice(0, 0, 2)]
    with pytest.raises(ValueError):
        slicing.plan(5, 0)
