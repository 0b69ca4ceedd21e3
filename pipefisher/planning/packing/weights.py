"""Weight gradients (W ops) as work the packer places within their step.

Where a schedule splits the backward, a W op (the weight gradient of a micro-batch) waits only for
its B op (the input gradient) on the same rank, and nothing of the step waits for it but its
stage's gradient consumers. So the packer may move it, as it moves curvature tasks, within these
bounds (all in the step's local time, on the timeline of a step with its preconditioning):

- **windows**: a rank's W ops run in its bubbles or where the schedule put W ops (`free`: the
  bubbles, less the margin, merged with the W ops' own intervals). Forwards, backwards and
  preconditions keep their times, so moving W ops delays nothing the schedule runs.
- **order**: a rank runs its W ops in the schedule's order, each after its B (`release`).
- **gradient consumers**: a stage's W ops end before its precondition starts (where that sits in a
  bubble; at the end of the step otherwise); without a precondition, before the schedule's own
  last W of the stage ends when a gradient reduction (`grad_reduce`) or the method's refresh work
  (methods that read the gradient, such as Shampoo) waits for the whole gradient.
- **memory**: a rank never holds more micro-batches pending their W, nor more activations held
  until their W, than the schedule does at its peak on that rank (`ir.peak_pending_weights`,
  `ir.peak_activations`): the m-th W ends before the rank's (m + pending peak)-th B and its
  (m + activation peak)-th forward start.

`latest[rank][m]` is the latest start of the rank's m-th W such that it and every later W still
fit these bounds (placed as late as possible, in order, into `free`). The schedule's own placement
meets every bound, so `latest[m]` is never before the schedule's start of that W: a packer that
never lets other work cross the next W's latest start, and runs that W by then, always finds room
for all of them. Pure Python: no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from pipefisher.core.ir import Op, OpKind, peak_activations, peak_pending_weights
from pipefisher.planning.simulate import Interval
from pipefisher.planning.tasks import CurvatureTasks

#: ``fixed``: W ops stay where the schedule put them; ``first``: a W runs as soon as its B is done
#: and its rank has room (pulled earlier); ``last``: a W runs only when no ready task fits before
#: its latest start (postponed, so that curvature runs first)
WeightPolicy = Literal["fixed", "first", "last"]
TOLERANCE = 1e-9


@dataclass(frozen=True)
class WeightWindows:
    """Per rank: the windows W ops may use (`free`, local (start, end), in time order), and its W
    ops in the schedule's order with their work, release and latest start (see the module
    docstring)."""

    free: tuple[tuple[tuple[float, float], ...], ...]
    ops: tuple[tuple[Op, ...], ...]
    work: tuple[tuple[float, ...], ...]
    release: tuple[tuple[float, ...], ...]
    latest: tuple[tuple[float, ...], ...]


def weight_windows(
    tasks: CurvatureTasks,
    free: tuple[tuple[tuple[float, float], ...], ...],
    preconditioned_ranks: tuple[tuple[Interval, ...], ...],
    precondition_window: dict[Op, float | None],
) -> WeightWindows:
    """The bounds of the module docstring for every rank: `free` are the windows of a step with
    its preconditioning (`preconditioned_ranks` its intervals), `precondition_window` where each
    precondition starts (None: after the step's work)."""
    merged, ops, works, releases, latests = [], [], [], [], []
    for rank, intervals in enumerate(preconditioned_ranks):
        weights = [iv for iv in intervals if iv.op.kind is OpKind.WEIGHT]
        windows = _merge(list(free[rank]) + [(iv.start, iv.end) for iv in weights])
        end_of = {iv.op: iv.end for iv in intervals}
        deadlines = _deadlines(tasks, rank, intervals, weights, precondition_window)
        merged.append(windows)
        ops.append(tuple(iv.op for iv in weights))
        works.append(tuple(iv.duration for iv in weights))
        releases.append(
            tuple(end_of[Op(OpKind.BACKWARD, iv.op.stage, iv.op.micro_batch, iv.op.pipe)] for iv in weights)
        )
        latests.append(_latest_starts(windows, works[-1], deadlines, weights))
    return WeightWindows(tuple(merged), tuple(ops), tuple(works), tuple(releases), tuple(latests))


def _merge(intervals: list[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    """Union of intervals, touching ones joined, in time order."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1] + TOLERANCE:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return tuple(merged)


def _deadlines(
    tasks: CurvatureTasks,
    rank: int,
    intervals: tuple[Interval, ...],
    weights: list[Interval],
    precondition_window: dict[Op, float | None],
) -> list[float]:
    """Per W of the rank (schedule order): when it must have ended (gradient consumers, memory)."""
    stage_deadline: dict[tuple[int, int], float] = {}
    preconditions = {(op.pipe, op.stage): op for op in tasks.per_step[rank] if op.kind is OpKind.PRECONDITION}
    reads_gradient = not tasks.rules.curvature
    for iv in weights:
        key = (iv.op.pipe, iv.op.stage)
        if key in preconditions:
            window = precondition_window[preconditions[key]]
            stage_deadline[key] = math.inf if window is None else window
        elif reads_gradient or tasks.durations.grad_reduce(iv.op.stage) > 0:
            stage_deadline[key] = max(stage_deadline.get(key, 0.0), iv.end)  # the schedule's last W of the stage
        else:
            stage_deadline[key] = math.inf
    starts = {kind: [iv.start for iv in intervals if iv.op.kind is kind] for kind in (OpKind.FORWARD, OpKind.BACKWARD)}
    bounds = (
        (OpKind.BACKWARD, peak_pending_weights(tasks.schedule.ranks[rank])),
        (OpKind.FORWARD, peak_activations(tasks.schedule.ranks[rank])),
    )
    deadlines = []
    for m, iv in enumerate(weights):
        deadline = stage_deadline[(iv.op.pipe, iv.op.stage)]
        for kind, peak in bounds:
            # after the (m + 1 + peak)-th op of `kind`, m + 1 W ops must have run
            if m + peak < len(starts[kind]):
                deadline = min(deadline, starts[kind][m + peak])
        deadlines.append(deadline)
    return deadlines


def _latest_starts(
    windows: tuple[tuple[float, float], ...], works: tuple[float, ...], deadlines: list[float], weights: list[Interval]
) -> tuple[float, ...]:
    """Latest start of each W (in order) such that it and all later ones fit `windows` in order and
    by their deadlines; never before the schedule's own start of it."""
    latest = [0.0] * len(works)
    bound, index = math.inf, len(windows) - 1
    for m in range(len(works) - 1, -1, -1):
        bound = min(bound, deadlines[m])
        while index >= 0 and windows[index][0] + works[m] > min(windows[index][1], bound) + TOLERANCE:
            index -= 1
        if index < 0:  # cannot happen: the schedule's own placement fits
            raise AssertionError(f"no room for {weights[m].op} before {bound}")
        latest[m] = bound = max(weights[m].start, min(windows[index][1], bound) - works[m])
    return tuple(latest)
