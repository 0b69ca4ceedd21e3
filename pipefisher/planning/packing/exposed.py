"""Exposed optimizer time: the share of the step a curvature method adds over the first-order step
of the same schedule and layout, on given op times, and where each rank's method work went.

`exposed_time` simulates a plan (every step of its refresh cycle, all of the method's ops) and
its schedule alone (the first-order step) on one set of op times; `MeasuredDurations` makes those
times the medians of measured ops (a run's own steps, or a trace's), so the figure describes the
run that measured them, not the profile it was packed from. Pure Python: no torch.
"""

from __future__ import annotations

import copy
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from pipefisher.core.ir import Op, OpKind, Schedule
from pipefisher.core.profile import Profile
from pipefisher.planning.packing.helpers import without_help
from pipefisher.planning.plan import Plan, cycle_time, simulate_plan
from pipefisher.planning.simulate import COLLECTIVES, Interval, OpDurations, Timeline, simulate_graph
from pipefisher.schedules.validate import schedule_graph

#: what an op's measured time is keyed by: its kind, stage, layer and part (as `OpDurations`)
TimingKey = tuple[OpKind, int, str | None, int | None]


def timing_key(op: Op) -> TimingKey:
    return (op.kind, op.stage, op.layer, op.part)


def op_samples(intervals: Iterable[Interval]) -> dict[TimingKey, list[float]]:
    """The durations of `intervals`, grouped by `timing_key` of their ops; collectives are left
    out (their interval on a rank is the launch, not the transfer)."""
    samples: dict[TimingKey, list[float]] = defaultdict(list)
    for interval in intervals:
        if interval.op.kind not in COLLECTIVES:
            samples[timing_key(interval.op)].append(interval.end - interval.start)
    return dict(samples)


class MeasuredDurations(OpDurations):
    """`OpDurations` whose ops take the median of their measured samples (`samples`, in
    `profile`'s time unit, keyed by `timing_key`); ops without samples (collectives, which are
    launched rather than run; ops no measured step ran) and transfers, reductions and the end of
    step take `profile`'s times."""

    def __init__(self, profile: Profile, samples: Mapping[TimingKey, Sequence[float]], split_backward: bool = False):
        super().__init__(profile, split_backward)
        self.measured = {key: statistics.median(values) for key, values in samples.items() if values}

    def _lookup(self, op: Op) -> float:
        found = self.measured.get(timing_key(op))
        return super()._lookup(op) if found is None else found

    def unhelped(self) -> MeasuredDurations:
        """These times with no help ops: each stage's precondition op also takes its helped
        layers' measured help time (the help ops' medians; the profile's where unmeasured)."""
        other = copy.copy(self)
        other.measured = dict(self.measured)
        for stage, layer in self.helped:
            help_op, precondition = Op(OpKind.HELP, stage, None, 0, layer), Op(OpKind.PRECONDITION, stage, None, 0)
            key = timing_key(precondition)
            other.measured[key] = other.measured.get(key, super()._lookup(precondition)) + self.measured.get(
                timing_key(help_op), self.layer(help_op).precondition
            )
        other.helped, other._work, other._cost_classes = frozenset(), {}, None
        return other


@dataclass(frozen=True)
class Exposed:
    """Predicted from one set of op times (their unit): `step_time`, the mean step over the plan's
    refresh cycle with all of the method's work; `first_order_step_time`, its schedule's step
    without any."""

    step_time: float
    first_order_step_time: float

    @property
    def share(self) -> float:
        """Exposed optimizer time: step_time / first_order_step_time - 1 (0.02: the method adds 2 %)."""
        return self.step_time / self.first_order_step_time - 1 if self.first_order_step_time > 0 else 0.0


def first_order_step_time(schedule: Schedule, durations: OpDurations) -> float:
    """`schedule` alone simulated on `durations`, its end of step without the method's own work in
    it (`OpDurations.first_order`): the first-order step an exposed share is over."""
    return simulate_graph(schedule_graph(schedule), durations.first_order(), schedule.name).step_time


def helpers_gain(plan: Plan, durations: MeasuredDurations) -> float:
    """How much shorter `plan`'s mean step is with its help ops than without them on the same
    measured times (`MeasuredDurations.unhelped`; negative: they cost more than they take off the
    step); 0 without help ops."""
    if not plan.helped:
        return 0.0
    helped = durations.helping(plan.helped)
    assert isinstance(helped, MeasuredDurations)
    with_help = cycle_time(simulate_plan(plan, helped))
    without = cycle_time(simulate_plan(without_help(plan), helped.unhelped()))
    return (without - with_help) / plan.refresh_steps


def exposed_time(plan: Plan, durations: OpDurations) -> Exposed:
    """`plan` and its schedule alone simulated on `durations` (made for the schedule's kind of
    backward: `OpDurations.split_backward`; the schedule's as `first_order_step_time`)."""
    with_method = cycle_time(simulate_plan(plan, durations)) / plan.refresh_steps
    return Exposed(with_method, first_order_step_time(plan.schedule, durations))


@dataclass(frozen=True)
class MethodShare:
    """One rank's method work in one step (times in the step's unit). `method`: the time its
    method ops (curvature, refresh, preconditioning: every op that is not a forward, backward or
    weight gradient) kept the rank busy. `exposed`: the part of it on the step's critical path,
    i.e. how much later than the first-order step on the same op times its last op ends
    (at most `method`); `hidden`, the rest: method work that ran where the first-order step
    leaves the rank idle. hidden + exposed = method."""

    rank: int
    method: float
    exposed: float

    @property
    def hidden(self) -> float:
        return self.method - self.exposed


def method_shares(step: Timeline, first_order: Timeline) -> list[MethodShare]:
    """Every rank's `MethodShare` of `step` against `first_order` (the same ranks' forward,
    backward and weight-gradient ops alone, simulated), both timed from their first op's start:
    the first-order step ends when its last op does."""
    origin = min((iv.start for intervals in step.ranks for iv in intervals), default=0.0)
    first_order_end = max((iv.end for intervals in first_order.ranks for iv in intervals), default=0.0)
    first_order_end -= min((iv.start for intervals in first_order.ranks for iv in intervals), default=0.0)
    shares = []
    for rank, intervals in enumerate(step.ranks):
        method = sum(iv.duration for iv in intervals if not iv.op.kind.is_compute)
        late = max((iv.end for iv in intervals), default=origin) - origin - first_order_end
        shares.append(MethodShare(rank, method, min(method, max(late, 0.0))))
    return shares
