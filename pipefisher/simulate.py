"""Duration-aware list scheduler: Schedule + Profile -> Timeline (start/end of every op).

Each rank runs its ops in list order; an op starts when its rank is free and its dependencies
have finished, plus the profile's p2p time when a dependency ran on another rank. A stage's
gradient reduction over its replicas (`grad_reduce`) starts when its gradient is final (its last
backward or preconditioning on that rank) and runs off the rank; after its last op and those
reductions a rank spends the step end of each stage it holds, independently of the other ranks (a
collective inside the end of step, such as global-norm clipping, also makes a rank that finished
early wait for the last one; that wait is not modelled). Times are in the profile's time unit.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

from pipefisher.ir import Op, OpKind, Schedule
from pipefisher.profile import LayerProfile, Profile, ProfileError
from pipefisher.validate import DependencyFn, execution_order, schedule_dependencies


@dataclass(frozen=True, slots=True)
class Interval:
    """`op` runs on its rank from `start` to `end` (profile time unit)."""

    op: Op
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class Bubble:
    """An idle gap of one rank within the step, [start, end)."""

    rank: int
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Timeline:
    """Per-rank intervals in execution order; the step spans [0, step_time].

    `comm_end` is when the last asynchronous collective launched in the step completes;
    `tails[rank]` (empty: all 0) the rank's busy end of step, which starts at `tail_start(rank)`:
    after its last op and once its stages' gradient reductions (`reduce_ends[rank]`, empty: all 0)
    are done.
    """

    ranks: tuple[tuple[Interval, ...], ...]
    time_unit: str = "units"
    comm_end: float = 0.0
    tails: tuple[float, ...] = ()
    reduce_ends: tuple[float, ...] = ()

    @cached_property
    def step_time(self) -> float:
        ends = (self.tail_start(rank) + self.tail(rank) for rank in range(self.num_ranks))
        return max(max(ends, default=0.0), self.comm_end)

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    def tail(self, rank: int) -> float:
        return self.tails[rank] if self.tails else 0.0

    def tail_start(self, rank: int) -> float:
        """When `rank`'s end of step starts: after its last op and its gradient reductions."""
        return max(self.last_end(rank), self.reduce_ends[rank] if self.reduce_ends else 0.0)

    def last_end(self, rank: int) -> float:
        """When `rank`'s last op ends (0 without ops)."""
        return max((iv.end for iv in self.ranks[rank]), default=0.0)

    def busy_time(self, rank: int) -> float:
        """Op time plus the end of step."""
        return sum(iv.duration for iv in self.ranks[rank]) + self.tail(rank)

    def bubble_time(self, rank: int) -> float:
        return self.step_time - self.busy_time(rank)

    def bubbles(self, rank: int, min_duration: float = 1e-9) -> list[Bubble]:
        """Windows for more work on `rank`: its idle gaps in [0, step_time - tail], including before
        its first and after its last op (work placed there ends before the rank's end of step)."""
        gaps, cursor = [], 0.0
        for iv in self.ranks[rank]:
            if iv.start - cursor > min_duration:
                gaps.append(Bubble(rank, cursor, iv.start))
            cursor = max(cursor, iv.end)
        end = self.step_time - self.tail(rank)
        if end - cursor > min_duration:
            gaps.append(Bubble(rank, cursor, end))
        return gaps

    def idle_gaps(self, rank: int, min_duration: float = 1e-9) -> list[Bubble]:
        """Where `rank` is idle, for drawing: the bubbles, but the gap after the last op is split
        around the rank's end of step, which starts at `tail_start` (same total as `bubbles`)."""
        gaps = self.bubbles(rank, min_duration)
        tail = self.tail(rank)
        if tail and gaps and gaps[-1].start >= self.last_end(rank) - 1e-12:
            last, start = gaps.pop(), self.tail_start(rank)
            gaps += [gap for gap in (Bubble(rank, last.start, start), Bubble(rank, start + tail, last.end + tail))
                     if gap.duration > min_duration]
        return gaps

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all ranks' time over the step, 0..1."""
        total = self.step_time * self.num_ranks
        return sum(self.bubble_time(r) for r in range(self.num_ranks)) / total if total else 0.0


COLLECTIVES = frozenset({OpKind.SYNC_A, OpKind.SYNC_B, OpKind.EXCHANGE})


class OpDurations:
    """Op times from a profile (see the profile module for units).

    Collectives (factor syncs, inverse exchanges) are launched asynchronously: they take no time
    on their rank, and whoever depends on one waits for its duration after the launch.
    """

    def __init__(self, profile: Profile):
        self.profile = profile
        self._layers = [{layer.name: layer for layer in stage.layers} for stage in profile.stages]
        self._work: dict[Op, float] = {}

    def layer(self, op: Op) -> LayerProfile:
        try:
            return self._layers[op.stage][op.layer]
        except (KeyError, IndexError):
            raise ProfileError(f"op {op}: stage {op.stage} of the profile has no layer {op.layer!r}") from None

    def work(self, op: Op) -> float:
        """How long `op` keeps its rank busy (collectives: the transfer, not the rank)."""
        cached = self._work.get(op)
        if cached is None:
            cached = self._work[op] = self._lookup(op)
        return cached

    def _lookup(self, op: Op) -> float:
        stage = self.profile.stages[op.stage]
        kind = op.kind
        if kind is OpKind.FORWARD:
            return stage.forward
        if kind is OpKind.BACKWARD:
            return stage.backward
        if kind is OpKind.PRECONDITION:
            return sum(layer.precondition for layer in stage.layers)
        layer = self.layer(op)
        return {
            OpKind.CURV_A: layer.curvature_a,
            OpKind.CURV_B: layer.curvature_b,
            OpKind.SYNC_A: layer.sync_a,
            OpKind.SYNC_B: layer.sync_b,
            OpKind.INV_A: layer.inverse_a,
            OpKind.INV_B: layer.inverse_b,
            OpKind.EXCHANGE: max(layer.sync_a, layer.sync_b),
        }[kind]

    def __call__(self, op: Op) -> float:
        """Time `op` occupies its rank."""
        return 0.0 if op.kind in COLLECTIVES else self.work(op)

    def step_end(self, stages: Iterable[int]) -> float:
        """End-of-step time of a rank that holds `stages`."""
        return sum(self.profile.stages[stage].step_end for stage in stages)

    def grad_reduce(self, stage: int) -> float:
        """The all-reduce of `stage`'s gradient over its replicas (asynchronous, off the rank)."""
        return self.profile.stages[stage].grad_reduce

    def delay(self, producer: Op, consumer: Op, cross_rank: bool) -> float:
        """Time between `producer` ending on its rank and `consumer` being able to use its result."""
        if producer.kind in COLLECTIVES:
            return self.work(producer)
        if cross_rank and producer.stage != consumer.stage:
            return self.profile.stages[min(producer.stage, consumer.stage)].p2p
        return 0.0


def simulate_ops(
    ranks: Sequence[Sequence[Op]], deps: DependencyFn, durations: OpDurations, name: str = "schedule"
) -> Timeline:
    """Timeline of per-rank op lists: each op starts when its rank is free and `deps(op)` are done."""
    end_of: dict[Op, float] = {}
    rank_of: dict[Op, int] = {}
    rank_free = [0.0] * len(ranks)
    intervals: list[list[Interval]] = [[] for _ in ranks]
    comm_end = 0.0
    #: (rank, stage) -> when the stage's gradient on that rank is final (last backward or precondition)
    gradient_final: dict[tuple[int, int], float] = {}
    for rank, op, op_deps in execution_order(ranks, deps, name):
        start = rank_free[rank]
        for dep in op_deps:
            start = max(start, end_of[dep] + durations.delay(dep, op, rank_of[dep] != rank))
        end = start + durations(op)
        end_of[op] = rank_free[rank] = end
        rank_of[op] = rank
        intervals[rank].append(Interval(op, start, end))
        if op.kind in COLLECTIVES:
            comm_end = max(comm_end, end + durations.work(op))
        if op.kind in (OpKind.BACKWARD, OpKind.PRECONDITION):
            gradient_final[(rank, op.stage)] = end
    reduce_ends = [0.0] * len(ranks)
    for (rank, stage), final in gradient_final.items():
        reduce_ends[rank] = max(reduce_ends[rank], final + durations.grad_reduce(stage))
    return Timeline(
        ranks=tuple(tuple(ivs) for ivs in intervals),
        time_unit=durations.profile.time_unit,
        comm_end=comm_end,
        tails=tuple(durations.step_end({op.stage for op in ops}) for ops in ranks),
        reduce_ends=tuple(reduce_ends),
    )


def simulate(schedule: Schedule, profile: Profile) -> Timeline:
    """Timeline of one step of `schedule` with the op times of `profile`."""
    check_profile(schedule, profile)
    return simulate_ops(schedule.ranks, schedule_dependencies(schedule), OpDurations(profile), schedule.name)


def check_profile(schedule: Schedule, profile: Profile) -> None:
    """Raise ProfileError unless `profile` has one entry per stage (per model chunk) of `schedule`."""
    chunks = schedule.params.get("chunks")
    if chunks:
        hint = f"{schedule.num_ranks} ranks x {chunks} chunks: one entry per model chunk"
    else:
        hint = "one entry per pipeline stage"
    profile.require_stages(schedule.num_stages, hint=hint)
