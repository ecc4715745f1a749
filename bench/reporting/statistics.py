"""The statistics every table and comparison states, in one place: how a metric's unit is shown and what range its
values can take (`Unit`), the 95% Student's t interval of a mean, clipped to that range and marked where the t
interval leaves it (`t_interval`), and the paired difference of two cells seed by seed with its one text form
(`paired`, `format_paired`).

Why clip: with three seeds and one run far from the others, a t interval spans values the metric cannot take (an
accuracy of 100.39%, a difference of -154 points). Clipping keeps every printed bound a possible value, and the mark
`CLIPPED` says the unclipped interval was wider still: such an interval says little beyond "the seeds disagree".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import pandas as pd

SIGNIFICANT = "*"
CLIPPED = "§"


@dataclass(frozen=True)
class Unit:
    """A metric's unit (`model.task.unit`): how tables show it and the values it can take."""

    name: str
    scale: float  # shown = value * scale
    digits: int  # decimals shown
    bounds: tuple[float, float]  # the values it can take, in recorded units
    suffix: str = ""  # after a plot axis' metric name

    def shown(self, value):
        return value * self.scale if value is not None and not pd.isna(value) else value

    @property
    def difference_bounds(self) -> tuple[float, float]:
        """The values a difference of two of its values can take."""
        low, high = self.bounds
        return low - high, high - low


UNITS = {
    "fraction": Unit("fraction", 100.0, 2, (0.0, 1.0), " (%)"),  # shown as a percentage
    "percent": Unit("percent", 1.0, 2, (0.0, 100.0), " (%)"),  # already points (SQuAD's EM and F1)
    "nats": Unit("nats", 1.0, 3, (0.0, math.inf)),  # a cross-entropy: seeds differ in the third decimal
}


def flag(value) -> bool:
    """A yes/no column's value as a bool, whichever way a frame or a CSV holds it (NaN: no)."""
    return value in (True, "True") if not (isinstance(value, float) and math.isnan(value)) else False


def unit(name: str | None) -> Unit:
    return UNITS[name or "fraction"]


class Interval(NamedTuple):
    lo: float
    hi: float
    clipped: bool = False  # the t interval reached past `bounds`, and was cut back to them


def t_interval(values, bounds: tuple[float, float] = (-math.inf, math.inf), confidence: float = 0.95) -> Interval:
    """Student's t interval for the mean of `values`, clipped to `bounds` (NaN, NaN with fewer than two values)."""
    values = np.asarray([v for v in values if not pd.isna(v)], dtype=float)
    if len(values) < 2:
        return Interval(np.nan, np.nan)
    from scipy import stats  # (scipy.stats: half a second; imported by the first interval, not by every command)

    half = stats.t.ppf((1 + confidence) / 2, len(values) - 1) * values.std(ddof=1) / np.sqrt(len(values))
    lo, hi = values.mean() - half, values.mean() + half
    clipped = bool(lo < bounds[0] or hi > bounds[1])
    return Interval(max(lo, bounds[0]), min(hi, bounds[1]), clipped)


class Paired(NamedTuple):
    """The mean over seeds of (this run's metric - its reference run's of the same seed), with its interval."""

    mean: float
    n: int
    interval: Interval

    @property
    def significant(self) -> bool:
        """Whether the interval excludes 0: a difference the seeds tell apart from noise."""
        return bool(self.interval.lo > 0 or self.interval.hi < 0)


def paired(differences, metric_unit: Unit) -> Paired:
    differences = [d for d in differences if not pd.isna(d)]
    return Paired(float(np.mean(differences)) if differences else np.nan, len(differences),
                  t_interval(differences, metric_unit.difference_bounds))


def format_paired(difference: Paired, metric_unit: Unit, with_n: bool = True) -> str:
    """`+d [lo, hi] (n=k)*§` in the metric's shown units: the mean difference, its 95% interval (clipped: §), the
    number of paired seeds (unless with_n is off), * where the interval excludes 0; "–" without a pair."""
    if not difference.n or pd.isna(difference.mean):
        return "–"
    digits = metric_unit.digits
    text = f"{metric_unit.shown(difference.mean):+.{digits}f}"
    count = f" (n={difference.n})" if with_n else ""
    lo, hi, clipped = difference.interval
    if pd.isna(lo):
        return text + count
    return (f"{text} [{metric_unit.shown(lo):+.{digits}f}, {metric_unit.shown(hi):+.{digits}f}]{count}"
            f"{SIGNIFICANT if difference.significant else ''}{CLIPPED if clipped else ''}")
