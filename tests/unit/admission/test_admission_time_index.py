"""TimeIndex: exact counts and token sums of entries up to a time, against a brute force."""

from hypothesis import given, settings
from hypothesis import strategies as st

from services.admission.time_index import TimeIndex


def test_counts_up_to_a_time_inclusive_within_one_bucket_and_across():
    ix = TimeIndex(origin=100.0, resolution=1.0)
    ix.add("a", 100.2, 10)
    ix.add("b", 100.7, 20)  # same bucket as a
    ix.add("c", 103.0, 40)
    ix.add("d", 99.0, 80)  # before the origin: bucket 0, still exact
    assert ix.upto(98.9) == (0, 0)
    assert ix.upto(99.0) == (1, 80)
    assert ix.upto(100.2) == (2, 90)
    assert ix.upto(100.69) == (2, 90)
    assert ix.upto(100.7) == (3, 110)
    assert ix.upto(102.99) == (3, 110)
    assert ix.upto(103.0) == (4, 150)
    assert ix.upto(1e9) == (4, 150)
    assert len(ix) == 4 and "c" in ix


def test_remove_and_replace():
    ix = TimeIndex()
    ix.add("a", 0.5, 3)
    ix.add("a", 2.5, 4)  # replaces
    assert ix.upto(1.0) == (0, 0) and ix.upto(3.0) == (1, 4)
    ix.remove("a")
    ix.remove("a")  # absent: nothing
    assert ix.upto(3.0) == (0, 0) and len(ix) == 0
    assert ix._tree == {} and ix._buckets == {}  # nothing left behind


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 30),
            st.floats(-5, 50, allow_nan=False),
            st.integers(0, 1000),
            st.booleans(),
        ),
        max_size=60,
    ),
    st.lists(st.floats(-10, 60, allow_nan=False), min_size=1, max_size=10),
)
def test_matches_brute_force(ops, queries):
    ix = TimeIndex(origin=0.0, resolution=0.25)
    ref: dict[int, tuple[float, int]] = {}
    for key, t, tokens, remove in ops:
        if remove:
            ix.remove(key)
            ref.pop(key, None)
        else:
            ix.add(key, t, tokens)
            ref[key] = (t, tokens)
        for x in queries:
            want = [n for t_, n in ref.values() if t_ <= x]
            assert ix.upto(x) == (len(want), sum(want))
