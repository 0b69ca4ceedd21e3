"""Percentiles of measured samples, as numpy computes them by default. Pure Python."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) of non-empty `values`, interpolating linearly between
    order statistics (numpy.percentile's default method)."""
    check_percentile(q)
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (position - low) * (ordered[high] - ordered[low])


def check_percentile(q: float) -> None:
    """ValueError unless 0 <= q <= 100."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q!r} is not in [0, 100]")
