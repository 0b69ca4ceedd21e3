"""Duration-aware list scheduler: Schedule + Profile -> Timeline (start/end of every op).

Each rank runs its ops in list order; an op starts when its rank is free and its dependencies
have finished, plus the profile's p2p time when a dependency ran on another rank. Times are in
the profile's time unit.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from pipefisher.ir import Op, OpKind, Schedule
from pipefisher.profile import LayerProfile, Profile, ProfileError
from pipefisher.validate import execution_order


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
    """Per-rank intervals in execution order; the step spans [0, step_time]."""

    ranks: tuple[tuple[Interval, ...], ...]
    time_unit: str = "units"

    @cached_property
    def step_time(self) -> float:
        return max((iv.end for ivs in self.ranks for iv in ivs), default=0.0)

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    def busy_time(self, rank: int) -> float:
        return sum(iv.duration for iv in self.ranks[rank])

    def bubble_time(self, rank: int) -> float:
        return self.step_time - self.busy_time(rank)

    def bubbles(self, rank: int, min_duration: float = 1e-9) -> list[Bubble]:
        """Idle gaps of `rank` in [0, step_time], including before its first and after its last op."""
        gaps, cursor = [], 0.0
        for iv in self.ranks[rank]:
            if iv.start - cursor > min_duration:
                gaps.append(Bubble(rank, cursor, iv.start))
            cursor = max(cursor, iv.end)
        if self.step_time - cursor > min_duration:
            gaps.append(Bubble(rank, cursor, self.step_time))
        return gaps

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all ranks' time over the step, 0..1."""
        total = self.step_time * self.num_ranks
        return sum(self.bubble_time(r) for r in range(self.num_ranks)) / total if total else 0.0


class OpDurations:
    """Looks up the duration of any op kind in a profile (see the profile module for units)."""

    def __init__(self, profile: Profile):
        self.profile = profile
        self._layers = [{layer.name: layer for layer in stage.layers} for stage in profile.stages]

    def layer(self, op: Op) -> LayerProfile:
        try:
            return self._layers[op.stage][op.layer]
        except KeyError:
            raise ProfileError(f"op {op}: stage {op.stage} of the profile has no layer {op.layer!r}") from None

    def __call__(self, op: Op) -> float:
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

    def transfer(self, producer: Op, consumer: Op) -> float:
        """P2P time between two adjacent stages (activation forward or its gradient backward)."""
        if producer.stage == consumer.stage:
            return 0.0
        return self.profile.stages[min(producer.stage, consumer.stage)].p2p


def simulate(schedule: Schedule, profile: Profile) -> Timeline:
    """Timeline of one step of `schedule` with the op times of `profile`."""
    profile.require_stages(schedule.num_stages, hint=_stage_hint(schedule))
    durations = OpDurations(profile)
    end_of: dict[Op, float] = {}
    rank_free = [0.0] * schedule.num_ranks
    intervals: list[list[Interval]] = [[] for _ in range(schedule.num_ranks)]
    for rank, op, deps in execution_order(schedule):
        start = rank_free[rank]
        for dep in deps:
            ready = end_of[dep]
            if schedule.rank_of(dep) != rank:
                ready += durations.transfer(dep, op)
            start = max(start, ready)
        end = start + durations(op)
        end_of[op] = rank_free[rank] = end
        intervals[rank].append(Interval(op, start, end))
    return Timeline(ranks=tuple(tuple(ivs) for ivs in intervals), time_unit=profile.time_unit)


def _stage_hint(schedule: Schedule) -> str:
    chunks = schedule.params.get("chunks")
    if chunks:
        return f"{schedule.num_ranks} ranks x {chunks} chunks: one entry per model chunk"
    return "one entry per pipeline stage"
