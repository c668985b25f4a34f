"""The Retry-After of requests turned away for a full prefill pool: spread over the time
the pool needs to serve them, not all at the floor."""

import pytest

from services.policy.retry_schedule import RetrySchedule


def test_a_burst_is_spread_over_the_pools_work():
    s = RetrySchedule()
    # Five rejections at t=10, each 2 s of one instance's work, excess 1 s, 2 instances.
    got = [s.retry_after(10.0, 1.0, 2.0, servers=2) for _ in range(5)]
    assert got == [1.0, 2.0, 3.0, 4.0, 5.0]


def test_the_excess_is_a_floor_and_the_queue_drains_with_time():
    s = RetrySchedule()
    assert s.retry_after(0.0, 1.0, 4.0, servers=1) == 1.0  # booked until 5.0
    assert s.retry_after(0.0, 1.0, 4.0, servers=1) == 5.0  # booked until 9.0
    assert s.retry_after(6.0, 1.0, 1.0, servers=1) == 3.0  # after the 9.0 booked
    assert s.retry_after(100.0, 1.0, 1.0, servers=1) == 1.0  # drained: the excess again
    assert s.retry_after(200.0, 7.5, 1.0, servers=1) == 7.5  # a larger excess wins


def test_the_horizon_bounds_it_and_is_not_booked():
    s = RetrySchedule(horizon_s=10.0)
    # Booked until 5, 9, 13; the fourth would come at 13 >= 10: the horizon, unbooked.
    assert [s.retry_after(0.0, 1.0, 4.0, servers=1) for _ in range(4)] == [1.0, 5.0, 9.0, 10.0]
    assert s.retry_after(0.0, 1.0, 4.0, servers=1) == 10.0  # still the horizon: not grown
    assert s.retry_after(4.0, 1.0, 1.0, servers=1) == pytest.approx(9.0)  # at 13 booked


def test_no_live_instance_counts_as_one():
    s = RetrySchedule()
    s.retry_after(0.0, 1.0, 3.0, servers=0)
    assert s.retry_after(0.0, 1.0, 3.0, servers=0) == 4.0
