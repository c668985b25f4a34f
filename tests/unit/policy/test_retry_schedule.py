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
