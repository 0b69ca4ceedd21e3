"""A Plan: per-rank op lists for every step of a refresh cycle, a curvature method's ops in
execution order.

The executor runs exactly these lists, step after step, cycle after cycle. `validate_plan`
checks a plan without its profile; `simulate_plan` predicts its timeline with one.

The plan file, `pipefisher.plan/v2`: ``{"schema", "method", "schedule", "steps"}``, `steps` a list
(steps of the cycle) of lists (ranks) of ops in the string form of `pipefisher.core.ir` version 2
(``2C0.5:block0.fc1``, ``2R1:block0.fc1``). Version 1 files (`pipefisher.plan/v1`, whose ops are
written ``2CA5:block0.fc1``, ``2IB:block0.fc1``) are read as well; a v1 file without `method`
is K-FAC's (`V1_METHOD`). The file names its method; the method's `TaskRules` come from whoever
loads it (`Plan.load(path, rules_of)`), since planning knows no method by name.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Sequence
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from itertools import chain
from pathlib import Path
from weakref import finalize

from pipefisher.core.files import load_structured, write_text_atomically
from pipefisher.core.ir import (
    PER_STEP_KINDS,
    Op,
    OpKind,
    Schedule,
    ScheduleError,
    peak_activations,
    peak_pending_weights,
)
from pipefisher.core.op_fields import layer_of
from pipefisher.core.profile import Profile
from pipefisher.core.profile_v1 import V1_METHOD
from pipefisher.planning.simulate import COLLECTIVES, OpDurations, Timeline, simulate_graph
from pipefisher.planning.tasks import CYCLE_KINDS, TaskGraph, collective_groups
from pipefisher.planning.vocabulary import TaskRules
from pipefisher.schedules.validate import OpGraph, execution_order, validate

PLAN_SCHEMA = "pipefisher.plan/v2"
PLAN_SCHEMA_V1 = "pipefisher.plan/v1"
#: the task rules of a method, by its name (the caller's lookup: the method registry)
RulesOf = Callable[[str], TaskRules]


@dataclass(frozen=True)
class Plan:
    """`steps[j][rank]`: the ops `rank` runs in step j of the cycle (0-based; len = refresh interval).

    Every step holds the schedule's forward/backward ops in the schedule's order; the ops of
    curvature method `method` (its name; `rules` its task rules, None for a plan of forward and
    backward ops alone) are inserted among them. Where the schedule
    splits the backward, every step holds each of its weight gradients (W) once, on the same rank,
    but the packer may move them within the step (after their backward, before their stage's
    precondition), holding no more pending weight gradients or activations on a rank than the
    schedule does (`weight_memory_problem`). Curvature in step 0
    reads that step's activations (or gradient); later steps reuse them; the results of the
    refresh work take effect at the first step of the next cycle.
    """

    schedule: Schedule
    steps: tuple[tuple[tuple[Op, ...], ...], ...]
    method: str = ""
    rules: TaskRules | None = None

    @property
    def refresh_steps(self) -> int:
        return len(self.steps)

    @cached_property
    def helped(self) -> frozenset[tuple[int, str]]:
        """The (stage, layer) pairs whose per-step work a help op does on another rank."""
        first = self.steps[0] if self.steps else ()
        return frozenset((op.stage, layer_of(op)) for ops in first for op in ops if op.kind is OpKind.HELP)

    def curvature_ops(self) -> list[Op]:
        """Every op of the cycle that is not a forward or backward, in step and rank order."""
        return [op for step in self.steps for ops in step for op in ops if not op.kind.is_compute]

    @property
    def graph(self) -> TaskGraph:
        ops = self.curvature_ops()
        return TaskGraph(self.schedule, ops, self.task_rules() if ops else None)

    def task_rules(self) -> TaskRules:
        """Its method's rules; ScheduleError when it was made without them."""
        if self.rules is None:
            raise ScheduleError(
                f"plan of method {self.method or 'none'}: its task rules are needed; load it with the method's rules"
            )
        return self.rules

    def to_dict(self) -> dict:
        return {
            "schema": PLAN_SCHEMA,
            "method": self.method,
            "schedule": self.schedule.to_dict(),
            "steps": [[[str(op) for op in ops] for ops in step] for step in self.steps],
        }

    @classmethod
    def from_dict(cls, data: dict, rules_of: RulesOf | None = None) -> Plan:
        """The plan of a file's content (v2 or v1); `rules_of` gives its method's rules (None:
        a plan without them, whose method's ops can be read but not checked or simulated)."""
        schema = data.get("schema") if isinstance(data, dict) else None
        if schema not in (PLAN_SCHEMA, PLAN_SCHEMA_V1):
            raise ScheduleError(f"schema: {schema!r} is not {PLAN_SCHEMA!r} or {PLAN_SCHEMA_V1!r}")
        try:
            steps = tuple(tuple(tuple(Op.parse(text) for text in ops) for ops in step) for step in data["steps"])
        except (KeyError, TypeError) as exc:
            raise ScheduleError(f"malformed plan JSON: {exc!r}") from None
        method = str(data.get("method", V1_METHOD if schema == PLAN_SCHEMA_V1 else ""))
        rules = rules_of(method) if rules_of is not None and method else None
        schedule = Schedule.from_dict(data["schedule"])
        if rules is not None and rules.deferred_statistics:
            steps = _with_folds(schedule, steps)
        return cls(schedule=schedule, steps=steps, method=method, rules=rules)

    def save(self, path: str | Path) -> None:
        write_text_atomically(path, json.dumps(self.to_dict()) + "\n")

    @classmethod
    def load(cls, path: str | Path, rules_of: RulesOf | None = None) -> Plan:
        """The plan in file `path` (`from_dict`); ScheduleError naming the file for anything that
        is not one."""
        return load_structured(
            path, "plan", lambda data: cls.from_dict(data, rules_of), ScheduleError, schema=PLAN_SCHEMA
        )


def _with_folds(schedule: Schedule, steps: tuple[tuple[tuple[Op, ...], ...], ...]):
    """`steps` of a plan written before fold ops (`OpKind.FOLD`) existed, with each (pipe, stage)'s
    at the start of its rank's list in every step; `steps` as they are when they have any."""
    if any(op.kind is OpKind.FOLD for step in steps for ops in step for op in ops):
        return steps
    folds = [
        [Op(OpKind.FOLD, stage, None, pipe) for (pipe, stage), r in sorted(schedule.placement.items()) if r == rank]
        for rank in range(schedule.num_ranks)
    ]
    return tuple(tuple(tuple(folds[rank]) + ops for rank, ops in enumerate(step)) for step in steps)


def _step_dependencies(graph: TaskGraph, step_ops: set[Op], first_step: bool):
    def deps(op: Op) -> tuple[Op, ...]:
        return tuple(dep for dep in graph.dependencies(op, first_step) if dep in step_ops)

    return deps


_FIXED = frozenset({OpKind.FORWARD, OpKind.BACKWARD})


def _fixed_ops(ops: Sequence[Op]) -> tuple[Op, ...]:
    """The forwards and backwards of an op list, in order (what a plan may not reorder)."""
    return tuple(op for op in ops if op.kind in _FIXED)


def weight_memory_problem(ops: Sequence[Op], schedule_ops: Sequence[Op]) -> str | None:
    """Why a rank's op list of a plan step holds more than the schedule's own list of that rank
    (more micro-batches whose weight gradient is pending, or more activations held until their
    weight gradient, at once), or None if it does not."""
    for what, peak in (("pending weight gradients", peak_pending_weights), ("activations", peak_activations)):
        held, allowed = peak(ops), peak(schedule_ops)
        if held > allowed:
            return f"it holds {held} micro-batches' {what} at once; its schedule holds at most {allowed}"
    return None


def moved_weights(plan: Plan) -> list[int]:
    """Per rank, how many weight gradients (counted over the cycle's steps) run at another place
    among the forward/backward ops than in the schedule."""

    def places(ops: Sequence[Op]) -> dict[Op, int]:
        found, fixed = {}, 0
        for op in ops:
            if op.kind in _FIXED:
                fixed += 1
            elif op.kind is OpKind.WEIGHT:
                found[op] = fixed
        return found

    moved = []
    for rank, schedule_ops in enumerate(plan.schedule.ranks):
        own = places(schedule_ops)
        moved.append(sum(own.get(op) != place for step in plan.steps for op, place in places(step[rank]).items()))
    return moved


def _check_collective_order(plan: Plan) -> None:
    """Every rank of a process group must launch the group's collectives in the same order."""
    groups = collective_groups(plan.schedule)
    sequences: dict[frozenset[int], dict[int, list[tuple]]] = defaultdict(lambda: defaultdict(list))
    for step in plan.steps:
        for rank, ops in enumerate(step):
            for op in ops:
                if op.kind in COLLECTIVES:
                    sequences[groups[op.stage]][rank].append((op.token, op.stage, op.layer))
    for group, per_rank in sequences.items():
        orders = {rank: per_rank.get(rank, []) for rank in sorted(group)}
        first_rank, first = next(iter(orders.items()))
        for rank, order in orders.items():
            if order != first:
                position = next(
                    (i for i, (a, b) in enumerate(zip(order, first)) if a != b), min(len(order), len(first))
                )
                raise ScheduleError(
                    f"collectives of ranks {sorted(group)} are launched in different orders: "
                    f"rank {first_rank} has {first[position : position + 1]}, rank {rank} has {order[position : position + 1]} "
                    f"at position {position}"
                )


def _check_method_kinds(plan: Plan) -> None:
    """Every op is of a kind (and part) the plan's method has (`TaskRules`)."""
    ops = plan.curvature_ops()
    if not ops:
        return
    rules = plan.task_rules()
    allowed: set[tuple[OpKind, int | None]] = {(OpKind.REFRESH, part) for part in rules.parts}
    allowed |= {(OpKind.SYNC, part) for part in rules.syncs}
    if rules.parts:
        allowed.add((OpKind.EXCHANGE, None))
    if rules.curvature:
        allowed |= {(OpKind.CURVATURE, part) for part in rules.parts}
    if rules.precondition:
        allowed.add((OpKind.PRECONDITION, None))
    if rules.deferred_statistics:
        allowed.add((OpKind.FOLD, None))
    if rules.helpers:
        allowed.add((OpKind.HELP, None))
    for op in ops:
        if (op.kind, op.part) not in allowed:
            what = op.kind.name if op.part is None else f"{op.kind.name} of part {op.part}"
            raise ScheduleError(f"{op}: method {plan.method} has no {what} ops")


def validate_plan(plan: Plan) -> Plan:
    """Check that `plan` can run; return it or raise ScheduleError.

    Each step keeps the schedule's forward/backward ops in order and runs each of its weight
    gradients once on their rank, holding no more than the schedule does (`weight_memory_problem`);
    every cycle op appears exactly once per cycle and every precondition, fold and help once per
    step, a help (of a layer of its stage's precondition) on a rank that does not hold its stage,
    every other method op on the rank of its stage; each op's dependencies run before it
    (earlier in the cycle, or earlier in the same step without deadlock); collectives are
    launched in the same order by all ranks of their group.
    """
    schedule = validate(plan.schedule)
    if not plan.steps:
        raise ScheduleError("a plan needs at least one step")
    _check_method_kinds(plan)
    graph = plan.graph
    seen: Counter[Op] = Counter()
    placed_before: set[Op] = set()
    for index, step in enumerate(plan.steps):
        if len(step) != schedule.num_ranks:
            raise ScheduleError(f"step {index} has {len(step)} ranks; the schedule has {schedule.num_ranks}")
        for rank, ops in enumerate(step):
            own = schedule.ranks[rank]
            if _fixed_ops(ops) != _fixed_ops(own):
                raise ScheduleError(f"step {index}, rank {rank}: forward/backward ops differ from the schedule's")
            weights = Counter(op for op in ops if op.kind is OpKind.WEIGHT)
            if weights != Counter(op for op in own if op.kind is OpKind.WEIGHT):
                raise ScheduleError(
                    f"step {index}, rank {rank}: weight gradients differ from the schedule's (each runs once per step)"
                )
            problem = weight_memory_problem(ops, own)
            if problem is not None:
                raise ScheduleError(f"step {index}, rank {rank}: {problem}")
            for op in ops:
                if not op.kind.is_compute and (schedule.placement.get((op.pipe, op.stage)) == rank) == (
                    op.kind is OpKind.HELP
                ):
                    where = "the rank of its stage" if op.kind is OpKind.HELP else "not on the rank of its stage"
                    raise ScheduleError(f"step {index}: {op} is on rank {rank}, {where}")
        step_ops = {op for ops in step for op in ops}
        per_step = Counter(op for ops in step for op in ops if op.kind in PER_STEP_KINDS)
        for op, count in per_step.items():
            if count > 1:
                raise ScheduleError(f"step {index}: {op} runs {count} times")
            if op.kind is OpKind.HELP and Op(OpKind.PRECONDITION, op.stage, None, op.pipe) not in per_step:
                raise ScheduleError(f"step {index}: {op} helps a stage without its precondition op in the step")
        for op in step_ops:
            if op.kind in CYCLE_KINDS:
                seen[op] += 1
                if seen[op] > 1:
                    raise ScheduleError(f"{op} runs more than once in the cycle (again in step {index})")
            for dep in graph.dependencies(op, first_step=index == 0):
                if dep not in step_ops and dep not in placed_before:
                    raise ScheduleError(f"step {index}: {op} needs {dep}, which has not run earlier in the cycle")
        if index > 0 and set(per_step) != set(op for op in placed_before if op.kind in PER_STEP_KINDS):
            raise ScheduleError(f"step {index}: preconditions or folds differ from step 0's")
        deps = _step_dependencies(graph, step_ops, first_step=index == 0)
        for _ in execution_order(step, deps, f"{schedule.name} step {index}"):
            pass
        placed_before |= step_ops
    _check_collective_order(plan)
    return plan


def simulate_plan(
    plan: Plan, profile: Profile | OpDurations, cache: dict | None = None, graph: TaskGraph | None = None
) -> list[Timeline]:
    """Predicted timeline of every step of the cycle (each step starts at time 0).

    `cache` (optional, owned by the caller) memoises step timelines across plans of one profile;
    `graph` (optional) is the plan's task graph when the caller has it.
    """
    graph = graph or plan.graph  # derived once for all steps
    durations = _durations(plan, profile)
    return [simulate_plan_step(plan, index, durations, cache, graph) for index in range(plan.refresh_steps)]


def simulate_plan_step(
    plan: Plan, index: int, profile: Profile | OpDurations, cache: dict | None = None, graph: TaskGraph | None = None
) -> Timeline:
    """Predicted timeline of step `index` of the cycle (see `simulate_plan`)."""
    step = plan.steps[index]
    key = (index == 0, step)
    if cache is not None and key in cache:
        return cache[key]
    durations = _durations(plan, profile)
    op_graph = _step_graph(step, graph or plan.graph, first_step=index == 0)
    timeline = simulate_graph(op_graph, durations, f"{plan.schedule.name} step {index}")
    if cache is not None:
        cache[key] = timeline
    return timeline


def _durations(plan: Plan, profile: Profile | OpDurations) -> OpDurations:
    """The op times of `plan`: `profile`'s, with the plan's helped layers (`Plan.helped`)."""
    durations = profile if isinstance(profile, OpDurations) else OpDurations(profile, plan.schedule.splits_backward)
    return durations.helping(plan.helped)


class _OpNumbers:
    """The ops a task graph's plans use, numbered once, with each op's dependencies (in the cycle's
    first step and in later ones) as those numbers, in the order `TaskGraph.dependencies` names them."""

    def __init__(self) -> None:
        self.number: dict[Op, int] = {}
        self.deps: tuple[dict[int, tuple[int, ...]], dict[int, tuple[int, ...]]] = ({}, {})

    def of(self, op: Op) -> int:
        number = self.number.get(op)
        if number is None:
            number = self.number[op] = len(self.number)
        return number

    def dependencies(self, graph: TaskGraph, op: Op, number: int, first_step: bool) -> tuple[int, ...]:
        table = self.deps[first_step]
        found = table.get(number)
        if found is None:
            found = table[number] = tuple(map(self.of, graph.dependencies(op, first_step)))
        return found


#: id(task graph) -> its op numbers, while the graph lives (see `_step_graph`)
_OP_NUMBERS: dict[int, _OpNumbers] = {}


def _step_graph(step: Sequence[Sequence[Op]], graph: TaskGraph, first_step: bool) -> OpGraph:
    """`op_graph(step, _step_dependencies(graph, ops of step, first_step))`, built on the ops'
    numbers in `graph` (computed once per graph): no dependency outside the step is kept, so the
    graph holds the step's places alone."""
    key = id(graph)
    numbers = _OP_NUMBERS.get(key)
    if numbers is None:
        numbers = _OP_NUMBERS[key] = _OpNumbers()
        finalize(graph, _OP_NUMBERS.pop, key, None)
    ops = list(chain.from_iterable(step))
    try:
        ids = list(map(numbers.number.__getitem__, ops))
    except KeyError:  # ops this graph has not numbered yet
        ids = list(map(numbers.of, ops))
    place = dict(zip(reversed(ids), range(len(ids) - 1, -1, -1)))  # an op's first place
    table, deps = numbers.deps[first_step], []
    for op, number in zip(ops, ids):
        found = table.get(number)
        if found is None:
            found = numbers.dependencies(graph, op, number, first_step)
        deps.append(tuple([place[dep] for dep in found if dep in place]))
    ranks, start = [], 0
    for rank_ops in step:
        ranks.append(list(map(place.__getitem__, ids[start : start + len(rank_ops)])))
        start += len(rank_ops)
    return OpGraph(ops=ops, ranks=ranks, deps=deps)


def cycle_time(timelines: Sequence[Timeline]) -> float:
    """Sum of step times over the cycle."""
    return sum(t.step_time for t in timelines)
