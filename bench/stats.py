"""The statistics the benchmarks report: a mean with its 95% interval (Student's t), and the rule
that repeats a paired measurement until that interval is narrow enough (or a cap is reached).

Standard library only; used by ``bench/bench_group.py`` (the paired overhead rows) and checked by
``tests/test_bench_runner.py``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

# Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom; past 30, the normal's 1.96
# is within 2% (a table: the benchmarks need no SciPy).
_T95 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t95(df: int) -> float:
    """The two-sided 95% quantile of Student's t with ``df`` degrees of freedom (df >= 1)."""
    if df < 1:
        raise ValueError(f"a t interval needs at least 1 degree of freedom, got {df}")
    return _T95[df - 1] if df <= len(_T95) else 1.96


@dataclass(frozen=True)
class Interval:
    """The mean of ``n`` values and its 95% interval ``[low, high]`` (None for n < 2)."""

    mean: float
    n: int
    low: float | None
    high: float | None

    @property
    def half_width(self) -> float | None:
        return None if self.low is None or self.high is None else (self.high - self.low) / 2

    def __str__(self) -> str:
        if self.half_width is None:
            return f"{self.mean:.3f} (n={self.n}, no interval)"
        return f"{self.mean:.3f} +/- {self.half_width:.3f} (95%, n={self.n})"


def mean_interval(values: Sequence[float]) -> Interval:
    """The mean of ``values`` with its 95% t interval."""
    if not values:
        raise ValueError("no values")
    mean = statistics.fmean(values)
    if len(values) < 2:
        return Interval(mean, len(values), None, None)
    half = t95(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return Interval(mean, len(values), mean - half, mean + half)


@dataclass(frozen=True)
class RepeatRule:
    """Repeat while fewer than ``minimum`` pairs were measured, or while the 95% interval of their
    differences is wider than +/- ``half_width``, until ``cap`` pairs or ``budget_s`` seconds."""

    minimum: int = 3
    half_width: float = 0.1
    cap: int = 12
    budget_s: float = 600.0
    unit: str = "s"  # of the differences, for the note (e.g. "on the log scale" for ratios; "": none)

    def more(self, differences: Sequence[float], spent_s: float) -> bool:
        n = len(differences)
        if n < self.minimum:
            return True
        if n >= self.cap or spent_s >= self.budget_s:
            return False
        half = mean_interval(differences).half_width
        return half is None or half > self.half_width

    def stopped_by(self, differences: Sequence[float], spent_s: float) -> str:
        """Why the repeats stopped, for the row's note."""
        n = len(differences)
        half = mean_interval(differences).half_width if differences else None
        unit = f" {self.unit}" if self.unit else ""
        if half is not None and half <= self.half_width and n >= self.minimum:
            return f"{n} pairs: the 95% interval reached +/-{self.half_width:g}{unit}"
        reached = "no interval" if half is None else f"95% interval +/-{half:.2f}{unit}"
        why = f"the cap of {self.cap} pairs" if n >= self.cap else f"the time budget of {self.budget_s:.0f} s"
        return f"{n} pairs, stopped by {why} ({reached}; target +/-{self.half_width:g}{unit})"
