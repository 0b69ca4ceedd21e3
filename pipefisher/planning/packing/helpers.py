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
first, each to the rank where the simulated cycle is shortest, kept only while the cycle gets
shorter. Pure Python: no torch.
"""

from __future__ import annotations

from pipefisher.core.ir import Op, OpKind
from pipefisher.planning.plan import Plan, cycle_time, simulate_plan
from pipefisher.planning.simulate import OpDurations
from pipefisher.planning.tasks import TaskGraph

#: a layer is handed out only if the cycle gets shorter by more than this share of it
_GAIN = 1e-6


def place_helpers(plan: Plan, durations: OpDurations, graph: TaskGraph | None = None) -> tuple[Plan, float]:
    """`plan` with help ops where they shorten its simulated cycle (module docstring), and that
    cycle's time; `plan` itself when its method has no helpers, the profile no `link_speed`
    (transfers could not be costed), or no layer pays."""
    graph = graph or plan.graph
    best = cycle_time(simulate_plan(plan, durations, graph=graph))
    rules = plan.rules
    if rules is None or not rules.helpers or durations.profile.link_speed <= 0:
        return plan, best
    for pipe, stage, owner in _stages_by_precondition_end(plan, durations, graph):
        layers = sorted(durations.profile.stages[stage].layers, key=lambda layer: (-layer.precondition, layer.name))
        for layer in layers:
            help_op = Op(OpKind.HELP, stage, None, pipe, layer.name)
            tried = [
                (cycle_time(simulate_plan(candidate, durations, graph=graph)), rank, candidate)
                for rank in range(plan.schedule.num_ranks)
                if rank != owner
                for candidate in [with_help(plan, help_op, rank)]
            ]
            if not tried:
                return plan, best
            time, _, candidate = min(tried, key=lambda entry: (entry[0], entry[1]))
            if time >= best * (1 - _GAIN):
                break
            plan, best = candidate, time
    return plan, best


def with_help(plan: Plan, help_op: Op, rank: int) -> Plan:
    """`plan` with `help_op` at the end of `rank`'s op list in every step."""
    steps = tuple(tuple(ops + (help_op,) if r == rank else ops for r, ops in enumerate(step)) for step in plan.steps)
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
