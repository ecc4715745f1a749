"""The tables' statistics (bench/reporting/statistics.py) against hand computations: a t interval that leaves the
metric's range is clipped to it and marked, in tables and in the comparison alike."""

import math

import pytest

from bench.reporting.statistics import UNITS, Interval, format_paired, paired, t_interval
from bench.tasks.base import METRIC_UNITS

# the committed default folder's bf16-mixed unit cell: seeds at 10.00%, 92.78%, 95.00%
STALLED_CELL = [0.1, 0.9277777777777777, 0.95]


def test_every_declared_unit_has_its_statistics():
    assert set(UNITS) == set(METRIC_UNITS)


def test_an_interval_past_the_metrics_range_is_clipped_and_marked():
    # by hand: mean 0.65926, sample std 0.48447, t(0.975, 2) = 4.30265: half-width 1.20349
    lo, hi, clipped = t_interval(STALLED_CELL, UNITS["fraction"].bounds)
    assert (lo, hi, clipped) == (0.0, 1.0, True)
    unclipped = t_interval(STALLED_CELL)
    assert (unclipped.lo == pytest.approx(0.65926 - 1.20349, abs=1e-4)
            and unclipped.hi == pytest.approx(1.86275, abs=1e-4))
    assert not unclipped.clipped
    inside = t_interval([0.92, 0.93, 0.94], UNITS["fraction"].bounds)  # well inside: untouched, unmarked
    assert not inside.clipped and inside.lo == pytest.approx(0.93 - 4.30265 * 0.01 / math.sqrt(3), rel=1e-5)
    assert t_interval([1.0], (0, 1)) == (pytest.approx(math.nan, nan_ok=True),) * 2 + (False,)  # one value: none


def test_a_loss_is_bounded_below_only_and_a_difference_by_the_range_of_two_values():
    # mean 0.31, sample std 0.51098, half-width 4.30265 * 0.51098 / sqrt(3) = 1.26934
    assert t_interval([0.01, 0.02, 0.9], UNITS["nats"].bounds) == (0.0, pytest.approx(1.57934, abs=1e-4), True)
    assert UNITS["fraction"].difference_bounds == (-1.0, 1.0) and UNITS["percent"].difference_bounds == (-100, 100)
    difference = paired([-0.85, -0.02, 0.0], UNITS["fraction"])  # the stalled cell's differences to FP32, roughly
    assert difference.interval.lo == -1.0 and difference.interval.clipped and not difference.significant


def test_one_text_for_every_paired_difference():
    fraction = UNITS["fraction"]
    assert format_paired(paired([0.01, 0.012, 0.011], fraction), fraction) == "+1.10 [+0.85, +1.35] (n=3)*"
    assert format_paired(paired([-0.85, -0.02, 0.0], fraction), fraction, with_n=False) == \
        "-29.00 [-100.00, +91.50]§"  # mean -0.29, std 0.48508, half-width 1.20501
    assert format_paired(paired([0.01], fraction), fraction) == "+1.00 (n=1)"
    assert format_paired(paired([], fraction), fraction) == "–"
    assert format_paired(paired([0.0123, 0.0125], UNITS["nats"]), UNITS["nats"]).startswith("+0.012 [")
    assert Interval(0.0, 1.0).clipped is False
