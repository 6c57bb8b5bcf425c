"""Figures of the benchmarks and the demo: the one percentile definition they share.

Nearest rank, as the benchmarks' reports have always used: the smallest sample such that
at least ``q`` percent of the samples are at or below it. It is one of the samples (an
``int`` stays an ``int``), so a p99 of 100 samples is the 99th smallest, and a p50 of an
even count is the lower middle sample (not the mean of the two middle ones).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TypeVar

T = TypeVar("T", int, float)


def percentile(values: Iterable[T], q: float) -> T | float:
    """Nearest-rank percentile `q` (0..100) of `values` (in any order); NaN when empty."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]
