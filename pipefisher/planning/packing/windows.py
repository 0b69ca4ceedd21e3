"""The windows a refresh cycle's tasks go into: every rank's bubbles of one step with its
preconditioning placed (`step_windows`), and the records of where the greedy placed each op (`Slot`,
`Placement`, `Placed`). Times are in the profile's unit. Pure Python: no torch."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from pipefisher.core.ir import Op
from pipefisher.planning.packing.weights import WeightWindows, weight_windows
from pipefisher.planning.simulate import Timeline, simulate_ops
from pipefisher.planning.tasks import CurvatureTasks

#: slack of time comparisons (profile time unit)
TOLERANCE = 1e-9


class Slot(NamedTuple):
    """Where an op sits in its rank's list of one step; lists are sorted by slot."""

    step: int
    #: local start of the window it runs in; forward/backward: its own first-order start;
    #: math.inf: after the step's own work
    window: float
    #: 0: forward/backward (and ops pinned right after one), 1: in a window, 2: after the step's work
    phase: int
    #: order of placement within the window (or after its forward/backward)
    sequence: int
    #: collectives: launched right after the op whose slot they share otherwise
    launch: int = 0


class Placement(NamedTuple):
    """An op's slot and its predicted global start and end (profile time unit)."""

    slot: Slot
    start: float
    end: float


class Placed(NamedTuple):
    """What the greedy placed: the cycle's tasks (those it could place), and, when it moved the
    weight gradients, their placement in each step it ran (`weights[j]`; empty: W ops fixed)."""

    tasks: dict[Op, Placement]
    weights: tuple[dict[Op, Placement], ...] = ()


@dataclass(frozen=True)
class Windows:
    """Per rank, the usable windows of one step as (local start, local end); each
    precondition's window start (None: after the step's work); the timeline of a step with
    preconditioning as its only K-FAC work, whose bubbles the windows are; and, where the
    schedule splits the backward, the bounds within which W ops may move (None otherwise)."""

    free: tuple[tuple[tuple[float, float], ...], ...]
    precondition_window: dict[Op, float | None]
    preconditioned: Timeline
    weights: WeightWindows | None = None

    def longest(self, rank: int) -> float:
        return max((end - start for start, end in self.free[rank]), default=0.0)


def step_windows(tasks: CurvatureTasks, first_order: Timeline, margin: float) -> Windows:
    """The windows of every step: each precondition goes into the first bubble after its
    stage's gradient is final (its last backward or weight gradient) that holds it, each fold
    into the step's first bubble that holds it (else after the step's work); the windows are the bubbles of that preconditioned step (so they include
    what a step ending later with its preconditioning leaves free on other ranks), less `margin`
    of each."""
    end_of = {iv.op: iv.end for intervals in first_order.ranks for iv in intervals}
    final = {
        op: max((end_of[dep] for dep in tasks.graph.dependencies(op)), default=0.0)
        for ops in tasks.per_step
        for op in ops
    }
    reserved: dict[Op, float | None] = {}
    ranks = []
    for rank, preconditions in enumerate(tasks.per_step):
        windows = [(b.start, b.end) for b in first_order.bubbles(rank)]
        for op in sorted(preconditions, key=final.__getitem__):
            work, release = tasks.durations(op), final[op]
            reserved[op] = None
            for index, (start, end) in enumerate(windows):
                if start >= release - TOLERANCE and end - start >= work - TOLERANCE:
                    reserved[op] = start
                    windows[index] = (start + work, end)
                    break
        items = [((iv.start, 0), iv.op) for iv in first_order.ranks[rank]]
        items += [((math.inf if (at := reserved[op]) is None else at, 1), op) for op in preconditions]
        ranks.append([op for _, op in sorted(items, key=lambda item: item[0])])
    preconditioned = simulate_ops(
        ranks, tasks.graph.dependencies, tasks.durations, f"{tasks.schedule.name} with preconditioning"
    )
    free = tuple(
        tuple(
            (b.start, b.end - margin * b.duration)
            for b in preconditioned.bubbles(rank)
            if b.duration * (1 - margin) > TOLERANCE
        )
        for rank in range(len(ranks))
    )
    moving = tasks.schedule.splits_backward
    weights = weight_windows(tasks, free, preconditioned.ranks, reserved) if moving else None
    return Windows(free, reserved, preconditioned, weights)
