"""What the windows of a step can hold: the least refresh interval per rank, and the per-step
precondition time inside the bubbles. Pure Python."""

from __future__ import annotations

import math

from pipefisher.core.ir import OpKind
from pipefisher.planning.packing.windows import TOLERANCE, Windows
from pipefisher.planning.simulate import Timeline
from pipefisher.planning.tasks import CurvatureTasks


def lower_bounds(tasks: CurvatureTasks, first_order: Timeline, windows: Windows) -> list[int]:
    """Per rank, the least k whose windows can hold the cycle's tasks (those longer than every
    window excluded), by two counts; at least 1. In the first step nothing runs before the
    rank's first forward ends (all its tasks wait for one of its forwards or backwards), so only
    the windows' time after it counts there. Time: every step offers its windows' time.
    Size: for each task length t, a window of length c holds at most floor(c / t) of the tasks at
    least t long."""
    bounds = []
    for rank, free in enumerate(windows.free):
        first_forward = min((iv.end for iv in first_order.ranks[rank] if iv.op.kind is OpKind.FORWARD), default=0.0)
        first = [max(0.0, end - max(start, first_forward)) for start, end in free]
        later = [end - start for start, end in free]
        longest = max(later, default=0.0)
        works = sorted((w for w in tasks.cycle_work[rank] if TOLERANCE < w <= longest + TOLERANCE), reverse=True)
        need = _steps_needed(sum(works), sum(first), sum(later))
        for count, size in enumerate(works, start=1):
            if count == len(works) or works[count] < size:  # the `count` tasks at least `size` long
                need = max(need, _steps_needed(count, _holding(first, size), _holding(later, size)))
        bounds.append(need)
    return bounds


def _holding(lengths: list[float], size: float) -> int:
    """How many tasks at least `size` long windows of these lengths hold at most."""
    return sum(math.floor(length / size + 1e-9) for length in lengths)


def _steps_needed(amount: float, first: float, later: float) -> int:
    """Least k with first + (k - 1) * later >= amount (1 when nothing later helps)."""
    if amount <= first + TOLERANCE or later <= TOLERANCE:
        return 1
    return 1 + max(0, math.ceil((amount - first) / later - 1e-9))


def precondition_in_bubbles(tasks: CurvatureTasks, windows: Windows, rank: int) -> float:
    """Per-step precondition time of `rank` that sits inside its bubbles."""
    return sum(tasks.durations(op) for op in tasks.per_step[rank] if windows.precondition_window[op] is not None)
