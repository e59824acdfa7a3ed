"""`RecentWindow`: the sliding window behind `ttfa_p90_s` and `batch_occupancy` (no Ray)."""
from __future__ import annotations

from deployments.metrics import RecentWindow


def test_nearest_rank_quantile_and_mean_over_the_window() -> None:
    window = RecentWindow(window_s=10.0)
    assert window.quantile(0.9, now=0.0) == 0.0 and window.mean(now=0.0) == 0.0
    for second, value in enumerate([5.0, 1.0, 4.0, 2.0, 3.0, 9.0, 8.0, 7.0, 6.0, 10.0]):
        window.add(value, now=float(second))
    assert window.quantile(0.9, now=9.0) == 9.0  # rank ceil(0.9 * 10) = 9 of 1..10
    assert window.quantile(0.5, now=9.0) == 5.0
    assert window.quantile(1.0, now=9.0) == 10.0
    assert window.mean(now=9.0) == 5.5


def test_old_values_leave_the_window() -> None:
    window = RecentWindow(window_s=10.0)
    window.add(100.0, now=0.0)
    window.add(1.0, now=5.0)
    assert window.quantile(0.9, now=10.0) == 100.0  # both inside [0, 10]
    assert window.quantile(0.9, now=10.5) == 1.0  # the value at t=0 expired
    assert window.mean(now=20.0) == 0.0


def test_values_expire_as_new_ones_come_even_if_never_read() -> None:
    """Serve reads the autoscaling stats only with an autoscaling config: a fixed-count replica's window must
    not keep every value it ever saw."""
    window = RecentWindow(window_s=10.0)
    for tenth in range(1000):  # 100 s of values, ten a second, never read
        window.add(1.0, now=tenth / 10)
    assert len(window) == 101  # 89.9 .. 99.9 s: the last 10 s and the value at the cutoff
    window.add(2.0, now=500.0)
    assert len(window) == 1 and window.mean(now=500.0) == 2.0
