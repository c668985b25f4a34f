"""The Retry-After of requests turned away for a full prefill pool: spread over the time
the pool needs to serve them, each back when it fits, not all at the floor."""

import pytest

from services.policy.retry_schedule import RetrySchedule


def test_a_burst_is_spread_over_the_pools_work():
    s = RetrySchedule()
    # Five rejections at t=10, each 2 s of one instance's work, excess 1 s, 2 instances,
    # no real backlog and no budget: each comes back when those before it are served.
    got = [s.retry_after(10.0, 1.0, 2.0, servers=2) for _ in range(5)]
    assert got == [1.0, 1.0, 2.0, 3.0, 4.0]


def test_each_comes_back_when_the_work_ahead_leaves_room_for_it():
    s = RetrySchedule(room_share=1.0)
    # One instance, 6 s queued, a 5 s budget. A 2 s request fits once 3 s are left
    # ahead of it: at 3 s. The next 2 s one has 8 s ahead: back at 5 s.
    assert s.retry_after(0.0, 1.0, 2.0, servers=1, backlog_s=6.0, budget_s=5.0) == 3.0
    assert s.retry_after(0.0, 1.0, 2.0, servers=1, backlog_s=6.0, budget_s=5.0) == 5.0
    # A short one (0.5 s) needs only 4.5 s of room: 10 s ahead, back at 5.5 s.
    assert s.retry_after(0.0, 1.0, 0.5, servers=1, backlog_s=6.0, budget_s=5.0) == 5.5


def test_by_default_half_the_room_is_left_to_new_arrivals():
    s = RetrySchedule()
    # As above, but back when 1.5 s (half of 3 s) are left ahead: at 4.5 s, then 6.5 s.
    assert s.retry_after(0.0, 1.0, 2.0, servers=1, backlog_s=6.0, budget_s=5.0) == 4.5
    assert s.retry_after(0.0, 1.0, 2.0, servers=1, backlog_s=6.0, budget_s=5.0) == 6.5


def test_the_excess_is_a_floor_and_the_queue_drains_with_time():
    s = RetrySchedule()
    assert s.retry_after(0.0, 1.0, 4.0, servers=1) == 1.0  # booked until 4.0
    assert s.retry_after(0.0, 1.0, 4.0, servers=1) == 4.0  # booked until 8.0
    assert s.retry_after(6.0, 1.0, 1.0, servers=1) == 2.0  # after the 8.0 booked
    assert s.retry_after(100.0, 1.0, 1.0, servers=1) == 1.0  # drained: the excess again
    assert s.retry_after(200.0, 7.5, 1.0, servers=1) == 7.5  # a larger excess wins


def test_the_horizon_bounds_it_and_is_not_booked():
    s = RetrySchedule(horizon_s=10.0)
    # Booked until 4, 8, 12; the fourth would come at 12 >= 10: the horizon, unbooked.
    assert [s.retry_after(0.0, 1.0, 4.0, servers=1) for _ in range(4)] == [1.0, 4.0, 8.0, 10.0]
    assert s.retry_after(0.0, 1.0, 4.0, servers=1) == 10.0  # still the horizon: not grown
    assert s.retry_after(4.0, 1.0, 1.0, servers=1) == pytest.approx(8.0)  # at 12 booked


def test_no_live_instance_counts_as_one():
    s = RetrySchedule()
    s.retry_after(0.0, 1.0, 3.0, servers=0)
    assert s.retry_after(0.0, 1.0, 3.0, servers=0) == 3.0


def test_a_promise_holds_its_room_until_claimed_or_lapsed():
    s = RetrySchedule(reserve=True, grace_s=2.0, hold_from=1)
    back = s.retry_after(0.0, 1.0, 3.0, servers=1, key="a")  # due at 1.0, 3 s of work
    assert back == 1.0
    assert s.ahead(0.5, by=0.9) == 0.0  # not due before a request starting at 0.9
    assert s.ahead(0.5, by=1.0) == 3.0  # due before one starting at 1.0: ahead of it
    s.claim("a", 1.2)  # it came back: nothing promised any more
    assert s.ahead(1.2, by=10.0) == 0.0
    s.retry_after(5.0, 1.0, 2.0, servers=2, key="b")  # due at 6.0, 1 s of the pool
    assert s.ahead(7.9, by=10.0) == 1.0
    assert s.ahead(8.0, by=10.0) == 0.0  # not claimed 2 s after its time: lapsed


def test_a_promise_made_again_replaces_the_old_one():
    s = RetrySchedule(reserve=True, grace_s=1.0, hold_from=1)
    s.retry_after(0.0, 1.0, 1.0, servers=1, key="a")  # due at 1.0
    s.claim("a", 1.0)
    s.retry_after(1.0, 4.0, 1.0, servers=1, key="a")  # turned away again: due at 5.0
    assert s.ahead(2.5, by=9.0) == 1.0  # the first promise's lapse (at 2.0) left it
    assert s.ahead(6.0, by=9.0) == 0.0


def test_without_reserve_nothing_is_promised():
    s = RetrySchedule()
    s.retry_after(0.0, 1.0, 3.0, servers=1, key="a")
    assert s.ahead(0.0, by=100.0) == 0.0


def test_only_the_promises_made_before_ones_own_are_ahead_of_it():
    s = RetrySchedule(reserve=True, grace_s=10.0, hold_from=1)
    s.retry_after(0.0, 1.0, 2.0, servers=1, key="a")  # promised first, due at 1.0
    s.retry_after(0.0, 1.0, 3.0, servers=1, key="b")  # then b, due at 2.0
    made = s.claim("b", 2.0)  # b is back: a's promise is ahead of it, not its own
    assert s.ahead(2.0, by=9.0, made_before=made) == 2.0
    made = s.claim("a", 2.5)  # a is back: nothing was promised before it
    assert s.ahead(2.5, by=9.0, made_before=made) == 0.0
    assert s.claim("c", 2.5) == float("inf")  # a newcomer: every promise is ahead of it


def test_a_request_passes_the_promises_only_when_its_work_is_short():
    s = RetrySchedule(reserve=True, pass_share=0.1)
    assert s.passes(0.4, budget_s=4.0)
    assert not s.passes(0.41, budget_s=4.0)
    assert not s.passes(0.1, budget_s=0.0)  # no room left: nothing passes


def test_only_a_request_turned_away_before_holds_its_room():
    """hold_from 2 (the default): a first rejection's promise is booked on the queue but
    holds no room; turned away again, the request's next promise does."""
    s = RetrySchedule(reserve=True, grace_s=2.0)
    first = s.retry_after(0.0, 1.0, 3.0, servers=1, key="a")  # due at 1.0
    assert s.ahead(0.5, by=10.0) == 0.0
    s.claim("a", first)
    again = s.retry_after(first, 1.0, 3.0, servers=1, key="a")  # back, turned away again
    assert s.ahead(first, by=first + again) == 3.0
    s.retry_after(0.0, 1.0, 2.0, servers=1, key="b")  # another request's first: not held
    assert s.ahead(first, by=100.0) == 3.0


def test_a_request_that_never_came_back_is_forgotten():
    s = RetrySchedule(reserve=True, grace_s=2.0)
    due = s.retry_after(0.0, 1.0, 3.0, servers=1, key="a")
    s.ahead(due + 2.0, by=0.0)  # past its time and the grace: forgotten
    s.retry_after(due + 2.0, 1.0, 3.0, servers=1, key="a")  # so this counts as a first
    assert s.ahead(due + 2.0, by=100.0) == 0.0
