"""Duration-aware list scheduler: Schedule + Profile -> Timeline (start/end of every op).

Each rank runs its ops in list order; an op starts when its rank is free and its dependencies
have finished, plus the profile's p2p time when a dependency ran on another rank. A stage's
gradient reduction over its replicas (`grad_reduce`) starts when its gradient is final (its last
backward, weight gradient or preconditioning on that rank) and runs off the rank; after its last op and those
reductions a rank spends the step end of each stage it holds, independently of the other ranks (a
collective inside the end of step, such as global-norm clipping, also makes a rank that finished
early wait for the last one; that wait is not modelled). Times are in the profile's time unit.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from itertools import repeat
from operator import add, attrgetter
from typing import Any

from pipefisher.core.ir import GRADIENT_KINDS, PER_STEP_KINDS, Op, OpKind, Schedule, splits_backward
from pipefisher.core.profile import LayerProfile, Profile, ProfileError
from pipefisher.schedules.validate import DependencyFn, Numbering, OpGraph, op_graph, schedule_graph


#: the profile's time of a part's op of each kind (`pipefisher.core.profile.PART_WORK`)
_WORK = {OpKind.CURVATURE: "curvature", OpKind.SYNC: "sync", OpKind.REFRESH: "refresh"}


@dataclass(frozen=True, slots=True)
class Interval:
    """`op` runs on its rank from `start` to `end` (profile time unit)."""

    op: Op
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start

    @classmethod
    def many(cls, ops: Iterable[Op], starts: Iterable[float], ends: Iterable[float]) -> list[Interval]:
        """`[Interval(op, start, end) for op, start, end in zip(ops, starts, ends)]`, built field by
        field in bulk: one constructor call per op would dominate simulating a large schedule."""
        fields: list[list[Any]] = [list(ops), list(starts), list(ends)]
        intervals: list[Interval] = list(map(object.__new__, repeat(cls, min(map(len, fields)))))
        slots = [getattr(cls, name) for name in ("op", "start", "end")]  # the __slots__ descriptors
        for slot, values in zip(slots, fields):
            for _ in map(slot.__set__, intervals, values):
                pass
        return intervals


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
            gaps += [
                gap
                for gap in (Bubble(rank, last.start, start), Bubble(rank, start + tail, last.end + tail))
                if gap.duration > min_duration
            ]
        return gaps

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all ranks' time over the step, 0..1."""
        total = self.step_time * self.num_ranks
        return sum(self.bubble_time(r) for r in range(self.num_ranks)) / total if total else 0.0


COLLECTIVES = frozenset({OpKind.SYNC, OpKind.EXCHANGE})
#: what an op's times depend on (see OpDurations)
_TIMING_FIELDS = attrgetter("kind", "stage", "layer", "part")


class OpDurations:
    """Op times from a profile (see the profile module for units).

    Collectives (factor syncs, inverse exchanges) are launched asynchronously: they take no time
    on their rank, and whoever depends on one waits for its duration after the launch.
    Every time depends on the ops' kind, stage, layer and part only (and `delay` on whether they
    cross ranks); the simulator relies on this to ask once per distinct case.
    """

    def __init__(self, profile: Profile, split_backward: bool = False):
        """`split_backward`: backwards are input gradients only (the op lists hold W ops)."""
        self.profile, self.split_backward = profile, split_backward
        self._layers = [{layer.name: layer for layer in stage.layers} for stage in profile.stages]
        self._work: dict[Op, float] = {}
        self._cost_classes: CostClasses | None = None

    @property
    def cost_classes(self) -> CostClasses:
        """The cost classes of the ops simulated with these durations (see `simulate_graph`)."""
        if self._cost_classes is None:
            self._cost_classes = CostClasses(self)
        return self._cost_classes

    def layer(self, op: Op) -> LayerProfile:
        try:
            if op.layer is not None:
                return self._layers[op.stage][op.layer]
        except (KeyError, IndexError):
            pass
        raise ProfileError(f"op {op}: stage {op.stage} of the profile has no layer {op.layer!r}")

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
            return stage.input_gradient if self.split_backward else stage.backward
        if kind is OpKind.WEIGHT:
            return stage.weight_gradient
        if kind in PER_STEP_KINDS:  # a method's per-step work: the profile's precondition time
            return sum(layer.precondition for layer in stage.layers)
        layer = self.layer(op)
        if kind is OpKind.EXCHANGE:
            return max(layer.sync, default=0.0)
        return layer.time(_WORK[kind], op.part)

    def __call__(self, op: Op) -> float:
        """Time `op` occupies its rank."""
        return 0.0 if op.kind in COLLECTIVES else self.work(op)

    def step_end(self, stages: Iterable[int]) -> float:
        """End-of-step time of a rank that holds `stages`."""
        return sum(self.profile.stages[stage].step_end for stage in stages)

    def first_order(self) -> OpDurations:
        """These durations with each stage's end of step less the method's own work in it
        (`StageProfile.method_step_end`): the first-order step's, for the exposed share."""
        plain = copy.copy(self)
        stages = tuple(
            replace(s, step_end=s.step_end - s.method_step_end, method_step_end=0.0) for s in self.profile.stages
        )
        plain.profile = replace(self.profile, stages=stages)
        return plain

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
    return simulate_graph(op_graph(ranks, deps), durations, name)


def simulate_graph(graph: OpGraph, durations: OpDurations, name: str = "schedule") -> Timeline:
    """`simulate_ops` of the lists and dependencies that `graph` holds. Durations made for the
    other kind of backward (whole or split; see `OpDurations`) are replaced by the right ones."""
    order_ranks, order = graph.order(name)
    split = splits_backward(graph.ops)
    if split != durations.split_backward:
        durations = OpDurations(durations.profile, split_backward=split)
    costs = _Costs(graph.ops, durations)
    busy, cost_class, delay, deps = costs.busy, costs.cost_class, costs.delay, graph.deps
    end = [0.0] * len(graph.ops)
    ran_on = [0] * len(graph.ops)
    rank_free = [0.0] * len(graph.ranks)
    starts: list[list[float]] = [[] for _ in graph.ranks]
    for rank, number in zip(order_ranks, order):
        start = rank_free[rank]
        consumer = cost_class[number]
        for dep in deps[number]:
            ready = end[dep] + delay[cost_class[dep], consumer, ran_on[dep] != rank]
            if ready > start:
                start = ready
        end[number] = rank_free[rank] = start + busy[number]
        ran_on[number] = rank
        starts[rank].append(start)
    classes = durations.cost_classes
    stage, collective, gradient = classes.stage, classes.collective, classes.gradient
    ranks, tails, reduce_ends, launched = [], [], [], []
    for numbers, begins in zip(graph.ranks, starts):
        ends = list(map(add, begins, map(busy.__getitem__, numbers)))
        ranks.append(tuple(Interval.many(map(graph.ops.__getitem__, numbers), begins, ends)))
        own = list(map(cost_class.__getitem__, numbers))
        tails.append(durations.step_end(set(map(stage.__getitem__, own))))
        # a stage's gradient is final at the end of its last backward (or W, precondition) here
        final = {stage[c]: end for c, end in zip(own, ends) if gradient[c]}
        reduce_ends.append(max((end + durations.grad_reduce(s) for s, end in final.items()), default=0.0))
        launched += [end + durations.work(classes.examples[c]) for c, end in zip(own, ends) if collective[c]]
    return Timeline(
        ranks=tuple(ranks),
        time_unit=durations.profile.time_unit,
        comm_end=max(launched, default=0.0),  # when the last collective launched in the step completes
        tails=tuple(tails),
        reduce_ends=tuple(reduce_ends),
    )


#: (producer cost class, consumer cost class, cross-rank)
_DelayKey = tuple[int, int, bool]


class _Memo(dict[_DelayKey, float]):
    """key -> compute(key), each key computed once."""

    def __init__(self, compute: Callable[[_DelayKey], float]) -> None:
        super().__init__()
        self.compute = compute

    def __missing__(self, key: _DelayKey) -> float:
        value = self[key] = self.compute(key)
        return value


class _Costs:
    """The times of numbered ops, asked of `durations` once per cost class: ops with the same
    kind, stage, layer and part (see OpDurations). The classes, their times and delays are kept on
    `durations` (`OpDurations.cost_classes`), so simulations with the same durations share them.

    `busy[i]`: how long op i keeps its rank busy; `cost_class[i]`: its class;
    `delay[(producer class, consumer class, cross-rank)]`: as `OpDurations.delay`.
    """

    def __init__(self, ops: Sequence[Op], durations: OpDurations) -> None:
        classes = durations.cost_classes
        self.cost_class = classes.number(ops)
        self.busy = list(map(classes.busy.__getitem__, self.cost_class))
        self.delay = classes.delay


class CostClasses:
    """The cost classes of the ops simulated so far with one `OpDurations`, numbered in order of
    first sight: `busy[c]` the time an op of class c occupies its rank, `delay` memoised
    `OpDurations.delay` by (producer class, consumer class, cross-rank)."""

    def __init__(self, durations: OpDurations) -> None:
        self.durations = durations
        self.classes: Numbering[tuple] = Numbering()
        self.examples: list[Op] = []
        self.busy: list[float] = []
        #: per class: its ops' stage, whether they are collectives, whether they finish a gradient
        self.stage: list[int] = []
        self.collective: list[bool] = []
        self.gradient: list[bool] = []
        examples = self.examples
        self.delay = _Memo(lambda key: durations.delay(examples[key[0]], examples[key[1]], key[2]))

    def number(self, ops: Sequence[Op]) -> list[int]:
        """The cost class of each of `ops` (new classes are numbered and timed)."""
        known = len(self.examples)
        cost_class = list(map(self.classes.__getitem__, map(_TIMING_FIELDS, ops)))
        if len(self.classes) > known:
            example = {number: op for number, op in zip(cost_class, ops) if number >= known}
            new = [example[number] for number in range(known, len(self.classes))]
            try:
                busy = list(map(self.durations, new))
            except ProfileError:  # forget the new classes: the next call meets them again
                for key in self.classes.added[known:]:
                    del self.classes[key]
                del self.classes.added[known:]
                self.classes.next_free = known
                raise
            self.examples += new
            self.busy += busy
            self.stage += (op.stage for op in new)
            self.collective += (op.kind in COLLECTIVES for op in new)
            self.gradient += (op.kind in GRADIENT_KINDS for op in new)
        return cost_class


def simulate(schedule: Schedule, profile: Profile, first_order: bool = False) -> Timeline:
    """Timeline of one step of `schedule` with the op times of `profile`; `first_order`: its end of
    step without the method's own work in it (`OpDurations.first_order`)."""
    check_profile(schedule, profile)
    durations = OpDurations(profile, schedule.splits_backward)
    return simulate_graph(
        schedule_graph(schedule), durations.first_order() if first_order else durations, schedule.name
    )


def check_profile(schedule: Schedule, profile: Profile) -> None:
    """Raise ProfileError unless `profile` has one entry per stage (per model chunk) of `schedule`."""
    chunks = schedule.params.get("chunks")
    if chunks:
        hint = f"{schedule.num_ranks} ranks x {chunks} chunks: one entry per model chunk"
    else:
        hint = "one entry per pipeline stage"
    profile.require_stages(schedule.num_stages, hint=hint)
