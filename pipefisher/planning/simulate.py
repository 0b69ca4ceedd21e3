"""Duration-aware list scheduler: Schedule + Profile -> Timeline (start/end of every op).

Each rank runs its ops in list order; an op starts when its rank is free and its dependencies
have finished, plus the profile's p2p time when a dependency ran on another rank. A stage's
gradient reduction over its replicas (`grad_reduce`) starts when its gradient is final (its last
backward, weight gradient or preconditioning on that rank) and runs off the rank; after its last op and those
reductions a rank spends the step end of each stage it holds, independently of the other ranks (a
collective inside the end of step, such as global-norm clipping, also makes a rank that finished
early wait for the last one; that wait is not modelled). A help op (`OpKind.HELP`: a layer's
per-step work of another rank's stage) starts once the layer's input has crossed the link, and
the stage's rank starts its end of step only once every helped layer's result is back. Times are
in the profile's time unit.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from operator import add, attrgetter

from pipefisher.core.ir import GRADIENT_KINDS, Op, OpKind, Schedule, splits_backward
from pipefisher.core.profile import LayerProfile, Profile, ProfileError
from pipefisher.planning.timeline import Bubble as Bubble, Interval, Timeline
from pipefisher.schedules.validate import DependencyFn, Numbering, OpGraph, op_graph, schedule_graph


#: the profile's time of a part's op of each kind (`pipefisher.core.profile.PART_WORK`)
_WORK = {OpKind.CURVATURE: "curvature", OpKind.SYNC: "sync", OpKind.REFRESH: "refresh"}


COLLECTIVES = frozenset({OpKind.SYNC, OpKind.EXCHANGE})
#: what an op's times depend on (see OpDurations)
_TIMING_FIELDS = attrgetter("kind", "stage", "layer", "part")


class OpDurations:
    """Op times from a profile (see the profile module for units).

    Collectives (factor syncs, inverse exchanges) are launched asynchronously: they take no time
    on their rank, and whoever depends on one waits for its duration after the launch.
    Every time depends on the ops' kind, stage, layer and part only (and `delay` on whether they
    cross ranks); the simulator relies on this to ask once per distinct case. `helped`: the
    (stage, layer) pairs whose per-step work help ops do on other ranks (`OpKind.HELP`): a help
    takes the layer's `precondition` time after its input crossed the link (`help_transfer`),
    the stage's precondition op the rest, and the owner's end of step waits for the result's way back.
    A fold op (`OpKind.FOLD`) takes the sum of its stage's layers' `fold` times.
    """

    def __init__(
        self, profile: Profile, split_backward: bool = False, helped: frozenset[tuple[int, str]] = frozenset()
    ):
        """`split_backward`: backwards are input gradients only (the op lists hold W ops)."""
        self.profile, self.split_backward, self.helped = profile, split_backward, helped
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

    def helping(self, helped: frozenset[tuple[int, str]]) -> OpDurations:
        """These durations (a copy of the same class) with `helped` layers' per-step work on
        helpers; self when unchanged."""
        if helped == self.helped:
            return self
        other = copy.copy(self)
        other.helped, other._work, other._cost_classes = helped, {}, None
        return other

    def help_transfer(self, op: Op) -> float:
        """The way of a help op's layer over the pipeline link, each direction: its weight's bytes
        at the profile's `link_speed` (0 when either is unknown)."""
        speed = self.profile.link_speed
        return self.layer(op).weight_bytes / speed if speed > 0 else 0.0

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
        if kind is OpKind.HELP:
            return self.layer(op).precondition
        if kind is OpKind.FOLD:
            return sum(layer.fold for layer in stage.layers)
        if kind is OpKind.PRECONDITION:  # the profile's precondition time, less the helped layers'
            return sum(layer.precondition for layer in stage.layers if (op.stage, layer.name) not in self.helped)
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
        if cross_rank and consumer.kind is OpKind.HELP:
            return self.help_transfer(consumer)
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
    stage, collective, gradient, helps = classes.stage, classes.collective, classes.gradient, classes.helps
    ranks, tails, reduce_ends, launched = [], [], [], []
    rank_ends = [list(map(add, begins, map(busy.__getitem__, numbers))) for numbers, begins in zip(graph.ranks, starts)]
    helped = _help_results(graph, cost_class, rank_ends, durations) if durations.helped else {}
    for numbers, begins, ends in zip(graph.ranks, starts, rank_ends):
        ranks.append(tuple(Interval.many(map(graph.ops.__getitem__, numbers), begins, ends)))
        own = list(map(cost_class.__getitem__, numbers))
        tails.append(durations.step_end({stage[c] for c in own if not helps[c]}))  # a help holds no stage
        # a stage's gradient is final at the end of its last backward (or W, precondition) here,
        # and its helped layers' results are back when the last has crossed the link
        final = {stage[c]: end for c, end in zip(own, ends) if gradient[c]}
        reduce_ends.append(
            max(
                (max(end + durations.grad_reduce(s), helped.get(s, 0.0)) for s, end in final.items()),
                default=0.0,
            )
        )
        launched += [end + durations.work(classes.examples[c]) for c, end in zip(own, ends) if collective[c]]
    return Timeline(
        ranks=tuple(ranks),
        time_unit=durations.profile.time_unit,
        comm_end=max(launched, default=0.0),  # when the last collective launched in the step completes
        tails=tuple(tails),
        reduce_ends=tuple(reduce_ends),
    )


def _help_results(
    graph: OpGraph, cost_class: Sequence[int], rank_ends: Sequence[Sequence[float]], durations: OpDurations
) -> dict[int, float]:
    """stage -> when the last result of its help ops is back on its own rank (each result
    crosses the link after its help op ends; a helped stage has one copy, so one owner)."""
    back: dict[int, float] = {}
    examples = durations.cost_classes.examples
    for numbers, ends in zip(graph.ranks, rank_ends):
        for number, end in zip(numbers, ends):
            op = examples[cost_class[number]]
            if op.kind is OpKind.HELP:
                back[op.stage] = max(back.get(op.stage, 0.0), end + durations.help_transfer(op))
    return back


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
        #: per class: its ops' stage, whether they are collectives, finish a gradient, help another rank
        self.stage: list[int] = []
        self.collective: list[bool] = []
        self.gradient: list[bool] = []
        self.helps: list[bool] = []
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
            self.helps += (op.kind is OpKind.HELP for op in new)
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
