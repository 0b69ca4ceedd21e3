"""Helpers: a stage's per-step work that has no bubble to go to, done in part on another rank.

A stage's gradient is final after its last backward, so its precondition op (P) waits for it; in
1F1B the first stage's last backward is the step's last op, and its P then runs while every other
rank idles (`pack` lists it as work with no bubble to go to). A method whose rules allow it
(`TaskRules.helpers`, Muon) can have a layer's share of P done elsewhere: a help op
(`OpKind.HELP`, ``0H:<layer>``) at the end of another rank's op list in every step. The layer's
input of the step crosses the link to the helper after the stage's gradient is final, and its
result crosses back before the stage's end of step (the simulator costs both ways by the layer's
`weight_bytes` at the profile's `link_speed`, `OpDurations.help_transfer`).

`place_helpers` hands layers out greedily: the stage whose P ends last first, its layers largest
first, each to the rank where the simulated cycle ends soonest (`finish_order`: the cycle's time,
then the ranks' ends of step latest first, so that where several stages' P ops end the step
together, taking work off one of them counts), a layer kept only where that order improves (one
of the same time and size as a layer that did not, since the last that did, is not tried). Then
a local search moves one help op at a time, to another rank or back into its stage's P op, while a
move improves that order (`_moved`): a rank busy with its own stage's P op when the greedy handed
out an earlier stage may be free once its own layers went out. The plan is kept only if its cycle
is shorter in the end. Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipefisher.core.ir import Op, OpKind
from pipefisher.core.layer_profile import LayerProfile
from pipefisher.planning.plan import Plan, cycle_time, simulate_plan
from pipefisher.planning.simulate import OpDurations
from pipefisher.planning.timeline import Timeline
from pipefisher.planning.tasks import TaskGraph

#: a layer is handed out only if the cycle gets shorter by more than this share of it
_GAIN = 1e-6
#: the local search after the greedy makes at most this many moves (each tries every help op on
#: every rank: a greedy's worth of simulations)
_MOVES = 8


def place_helpers(plan: Plan, durations: OpDurations, graph: TaskGraph | None = None) -> tuple[Plan, float]:
    """`plan` with help ops where they shorten its simulated cycle (module docstring), and that
    cycle's time; `plan` itself when its method has no helpers, the profile no `link_speed`
    (transfers could not be costed), or the cycle does not get shorter."""
    graph = graph or plan.graph
    start = simulate_plan(plan, durations, graph=graph)
    rules = plan.rules
    if rules is None or not rules.helpers or durations.profile.link_speed <= 0 or plan.schedule.num_ranks < 2:
        return plan, cycle_time(start)
    placed, best = plan, finish_order(start)
    for pipe, stage, owner in _stages_by_precondition_end(plan, durations, graph):
        layers = sorted(durations.profile.stages[stage].layers, key=lambda layer: (-layer.precondition, layer.name))
        failed: set[tuple[float, int]] = set()  # costs of layers that did not pay since the last that did
        for layer in layers:
            if _cost(layer) in failed:
                continue
            help_op = Op(OpKind.HELP, stage, None, pipe, layer.name)
            score, _, candidate = min(
                (finish_order(simulate_plan(candidate, durations, {}, graph)), rank, candidate)
                for rank in range(plan.schedule.num_ranks)
                if rank != owner
                for candidate in [with_help(placed, help_op, rank)]
            )
            if _shorter(score, best):
                placed, best, failed = candidate, score, set()
            else:
                failed.add(_cost(layer))
    placed, best = _moved(placed, best, durations, graph)
    if not best[0] < cycle_time(start) * (1 - _GAIN):
        return plan, cycle_time(start)
    return placed, best[0]


def _moved(
    plan: Plan, best: tuple[float, ...], durations: OpDurations, graph: TaskGraph
) -> tuple[Plan, tuple[float, ...]]:
    """`plan` after moving help ops one at a time, each move the one whose plan comes first in
    `finish_order`, while one improves it (at most `_MOVES` moves): to another rank
    but its stage's, or back into its stage's P op. The greedy hands the stage whose P ends last
    out first, when the ranks of the stages after it are still busy with their own P; once those
    are helped in turn, some of them end sooner and can take a share back."""
    for _ in range(_MOVES):
        found: tuple[tuple[float, ...], Plan] | None = None
        for rank, op in help_ops(plan):
            owner, rest = plan.schedule.placement[(op.pipe, op.stage)], _without(plan, op)
            for target in range(plan.schedule.num_ranks):
                if target == rank:
                    continue
                candidate = rest if target == owner else with_help(rest, op, target)
                score = finish_order(simulate_plan(candidate, durations, {}, graph))
                if _shorter(score, found[0] if found else best):
                    found = (score, candidate)
        if found is None:
            break
        best, plan = found
    return plan, best


def help_ops(plan: Plan) -> list[tuple[int, Op]]:
    """(rank, help op) of every help op of `plan`, in rank and op order (alike in every step)."""
    first = plan.steps[0] if plan.steps else ()
    return [(rank, op) for rank, ops in enumerate(first) for op in ops if op.kind is OpKind.HELP]


def _without(plan: Plan, help_op: Op) -> Plan:
    """`plan` without `help_op` (its layer back on its stage's P op)."""
    steps = tuple(tuple(tuple(op for op in ops if op != help_op) for ops in step) for step in plan.steps)
    return Plan(plan.schedule, steps, plan.method, plan.rules)


def _cost(layer: LayerProfile) -> tuple[float, int]:
    """What a layer's help costs (its time, its bytes): layers alike in both pay or not alike."""
    return layer.precondition, layer.weight_bytes


def finish_order(timelines: Sequence[Timeline]) -> tuple[float, ...]:
    """The cycle's time, then the sum over its steps of the ranks' ends of step, latest first
    (second latest, ...): handing work from the latest rank counts where another ends as late."""
    ends = [sorted((t.tail_start(r) + t.tail(r) for r in range(t.num_ranks)), reverse=True) for t in timelines]
    return (cycle_time(timelines), *(sum(column) for column in zip(*ends)))


def _shorter(score: tuple[float, ...], best: tuple[float, ...]) -> bool:
    """Whether `score` comes first in `finish_order`, by more than `_GAIN` of the cycle."""
    for new, old in zip(score, best):
        if abs(new - old) > _GAIN * best[0]:
            return new < old
    return False


def with_help(plan: Plan, help_op: Op, rank: int) -> Plan:
    """`plan` with `help_op` in `rank`'s op list in every step: after the rank's help ops of the
    same stage, before those of other stages (`place_helpers` hands out the stage whose gradient is
    final last first, so a stage handed out later has its inputs sooner), else at the end."""

    def added(ops: tuple[Op, ...]) -> tuple[Op, ...]:
        helps = [i for i, op in enumerate(ops) if op.kind is OpKind.HELP]
        same = [i for i in helps if (ops[i].pipe, ops[i].stage) == (help_op.pipe, help_op.stage)]
        at = same[-1] + 1 if same else helps[0] if helps else len(ops)
        return ops[:at] + (help_op,) + ops[at:]

    steps = tuple(tuple(added(ops) if r == rank else ops for r, ops in enumerate(step)) for step in plan.steps)
    return Plan(plan.schedule, steps, plan.method, plan.rules)


def without_help(plan: Plan) -> Plan:
    """`plan` without its help ops (their layers back on their stages' precondition ops)."""
    steps = tuple(tuple(tuple(op for op in ops if op.kind is not OpKind.HELP) for ops in step) for step in plan.steps)
    return Plan(plan.schedule, steps, plan.method, plan.rules)


def helped_layers(plan: Plan) -> dict[tuple[int, int], list[tuple[str, int]]]:
    """(pipe, stage) -> its helped layers and the rank that helps each, in the helper's order."""
    found: dict[tuple[int, int], list[tuple[str, int]]] = {}
    for rank, ops in enumerate(plan.steps[0] if plan.steps else ()):
        for op in ops:
            if op.kind is OpKind.HELP and op.layer is not None:
                found.setdefault((op.pipe, op.stage), []).append((op.layer, rank))
    return found


def _stages_by_precondition_end(plan: Plan, durations: OpDurations, graph: TaskGraph) -> list[tuple[int, int, int]]:
    """(pipe, stage, rank) of every precondition op of the cycle's first step, latest end first."""
    timeline = simulate_plan(plan, durations, graph=graph)[0]
    ends = [
        (interval.end, interval.op.pipe, interval.op.stage, rank)
        for rank, intervals in enumerate(timeline.ranks)
        for interval in intervals
        if interval.op.kind is OpKind.PRECONDITION
    ]
    return [(pipe, stage, rank) for _, pipe, stage, rank in sorted(ends, key=lambda entry: -entry[0])]
