"""The cache-slot budget's rules (``service.engine.slots``): rows padded to the
longest, one more round of growth, a lone row always fits, the earliest row
never preempted."""

import pytest

from service.engine.slots import fits, preempted


def test_rows_fit_while_rows_times_the_grown_longest_row_stays_within_the_budget():
    assert fits([10, 30], budget=92, growth=16)  # 2 x (30 + 16) = 92
    assert not fits([10, 31], budget=92, growth=16)
    assert not fits([31, 10], budget=92, growth=16)  # the longest row decides, wherever it is
    assert fits([10] * 4, budget=104, growth=16) and not fits([10] * 5, budget=104, growth=16)


@pytest.mark.parametrize("widths", [[], [5000]])
def test_no_rows_or_a_lone_row_always_fit(widths):
    assert fits(widths, budget=100, growth=16)


def test_a_budget_of_zero_is_no_limit():
    assert fits([10_000] * 64, budget=0, growth=16) and preempted([10_000] * 64, budget=0, growth=16) == 0


def test_the_latest_rows_leave_until_the_rest_fit_and_never_the_first():
    assert preempted([20, 20, 20], budget=108, growth=16) == 0  # 3 x 36
    assert preempted([20, 20, 21], budget=108, growth=16) == 1  # 2 x 37 fits
    assert preempted([60, 20, 20, 20], budget=108, growth=16) == 3  # the first alone
    assert preempted([5000, 20], budget=108, growth=16) == 1
    assert preempted([5000], budget=108, growth=16) == 0
