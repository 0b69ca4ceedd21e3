"""An exact packer for small refresh cycles: a mixed-integer model solved by HiGHS (the optional
``solver`` extra, `highspy`), giving the smallest refresh interval k whose least added step time
fits the overhead budget, and that least added time.

The model (docs/packing.md, "The exact solver", states it in full): every cycle task of a rank
(curvature, refresh work; collectives take no rank time) goes into exactly one *slot* of its
rank: a window (a bubble of the preconditioned step, the greedy's `Windows`) of one of the k
steps, or the tail after that step's own work (capacity 0). A slot's load beyond its capacity is
overflow; a step's added time is the largest overflow summed over one rank's slots of that step;
the objective is the added time summed over the k steps. A task follows its same-rank
dependencies in slot order (the same slot allowed), its other-rank dependencies in step order,
and never sits in a first-step window that ends before its first-step input is ready.
Times are in the profile's unit. Pure Python apart from `highspy`, imported when a model is solved.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from pipefisher.core.ir import Op, Schedule
from pipefisher.core.profile import Profile
from pipefisher.planning.packing.bounds import lower_bounds
from pipefisher.planning.packing.greedy import place
from pipefisher.planning.packing.options import PackOptions
from pipefisher.planning.packing.pack import packing_problem
from pipefisher.planning.packing.windows import TOLERANCE, Windows, step_windows
from pipefisher.planning.simulate import COLLECTIVES, Timeline
from pipefisher.planning.tasks import CurvatureTasks
from pipefisher.planning.vocabulary import TaskRules

__all__ = ["ExactResult", "CycleModel", "cycle_model", "solve_cycle", "least_added_time"]


@dataclass(frozen=True)
class Slot:
    """One place a task can go: `step`, its rank, its order among the rank's slots over the cycle
    (`index`), its global start and end (the tail: start = end = the step's end) and capacity."""

    rank: int
    step: int
    index: int
    start: float
    end: float

    @property
    def capacity(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class CycleModel:
    """The data of the model at one k: per task its rank, work and first-step release; the
    dependencies between tasks (pairs of task indices, collectives resolved through); the slots."""

    refresh_steps: int
    ops: tuple[Op, ...]
    rank: tuple[int, ...]
    work: tuple[float, ...]
    release: tuple[float, ...]
    dependencies: tuple[tuple[int, int], ...]  # (task, the task it waits for)
    slots: tuple[Slot, ...]

    def allowed(self, task: int) -> list[int]:
        """The slots `task` may take: its rank's, less first-step windows ending before its release."""
        return [
            s
            for s, slot in enumerate(self.slots)
            if slot.rank == self.rank[task]
            and (slot.capacity <= TOLERANCE or slot.end > self.release[task] + TOLERANCE)
        ]


@dataclass(frozen=True)
class ExactResult:
    """The solver's answer: the smallest k (`refresh_steps`) whose least added time per step
    (`added_time`, profile unit; `overhead`: as a share of the first-order step) fits the budget
    (`fits` False: none up to `max_steps` did; the last k tried is given); `optimal` False: a
    solve hit its time limit (the values are the best found, an upper bound); `tried`: the k
    solved with their added time per step; `binaries`: the largest model's binary variables."""

    refresh_steps: int
    added_time: float
    overhead: float
    fits: bool
    optimal: bool
    tried: tuple[tuple[int, float], ...]
    binaries: int
    seconds: float


class _Prepared:
    """Tasks, first-order timeline and windows of one packing problem (as `pack` derives them)."""

    def __init__(self, schedule: Schedule, profile: Profile, rules: TaskRules, options: PackOptions):
        self.tasks: CurvatureTasks
        self.first_order: Timeline
        self.tasks, self.first_order = packing_problem(schedule, profile, rules, options)
        self.windows: Windows = step_windows(self.tasks, self.first_order, options.margin)
        self.lower_bound = max(lower_bounds(self.tasks, self.first_order, self.windows))


def cycle_model(prepared: _Prepared, refresh_steps: int) -> CycleModel:
    """The model's data at k = `refresh_steps` (see the module docstring)."""
    tasks, windows = prepared.tasks, prepared.windows
    period = windows.preconditioned.step_time
    ops, rank, work = [], [], []
    for r, (cycle, works) in enumerate(zip(tasks.cycle, tasks.cycle_work)):
        for op, w in zip(cycle, works):
            if op.kind not in COLLECTIVES:
                ops.append(op)
                rank.append(r)
                work.append(w)
    index = {op: i for i, op in enumerate(ops)}
    fo_end = {iv.op: iv.end for intervals in prepared.first_order.ranks for iv in intervals}
    release = [max((fo_end[d] for d in tasks.graph.first_step_inputs(op)), default=0.0) for op in ops]

    def resolved(op: Op) -> set[Op]:
        found: set[Op] = set()
        for dep in tasks.graph.dependencies(op):
            if dep.kind in COLLECTIVES:
                found |= resolved(dep)
            elif dep in index:
                found.add(dep)
        return found

    dependencies = tuple(
        (i, index[dep]) for i, op in enumerate(ops) for dep in sorted(resolved(op), key=index.__getitem__)
    )
    slots = []
    for r, free in enumerate(windows.free):
        order = 0
        for step in range(refresh_steps):
            for start, end in sorted(free):
                slots.append(Slot(r, step, order, step * period + start, step * period + end))
                order += 1
            tail = (step + 1) * period
            slots.append(Slot(r, step, order, tail, tail))
            order += 1
    return CycleModel(refresh_steps, tuple(ops), tuple(rank), tuple(work), tuple(release), dependencies, tuple(slots))


def _highspy() -> Any:
    try:
        import highspy
    except ImportError:
        raise ImportError(
            "the exact packer needs HiGHS: pip install 'pipefisher[solver]' (the highspy package)"
        ) from None
    return highspy


def greedy_start(prepared: _Prepared, model: CycleModel) -> list[int]:
    """Per task, the slot the ``fill`` greedy (W ops where the schedule put them) puts it in:
    its window, or, where it places the task in no step below k, the last step's tail. A
    feasible point of the model: the solver starts from it, so it is never worse than that."""
    placed = place(prepared.tasks, prepared.first_order, prepared.windows, "fill", model.refresh_steps).tasks
    period = prepared.windows.preconditioned.step_time
    window = {
        (slot.rank, slot.step, round(slot.start - slot.step * period, 6)): s for s, slot in enumerate(model.slots)
    }
    tail = {slot.rank: s for s, slot in enumerate(model.slots) if slot.step == model.refresh_steps - 1}
    found = []
    for op, rank in zip(model.ops, model.rank):
        p = placed.get(op)
        found.append(tail[rank] if p is None else window[(rank, p.slot.step, round(p.slot.window, 6))])
    return found


def least_added_time(model: CycleModel, time_limit: float, start: list[int] | None = None) -> tuple[float, bool, int]:
    """(least added time summed over the cycle's steps, proven optimal, binary variables);
    `start`: a slot per task to start the search from (`greedy_start`)."""
    highspy = _highspy()
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit))
    h.setOptionValue("threads", 1)
    y: dict[tuple[int, int], Any] = {}
    for t in range(len(model.ops)):
        allowed = model.allowed(t)
        for s in allowed:
            y[(t, s)] = h.addBinary()
        h.addConstr(sum(y[(t, s)] for s in allowed) == 1)
    by_slot: dict[int, list[int]] = {}
    for t, s in y:
        by_slot.setdefault(s, []).append(t)
    overflow = {s: h.addVariable(lb=0.0) for s in by_slot}
    steps = model.refresh_steps
    added = [h.addVariable(lb=0.0, obj=1.0) for _ in range(steps)]
    for s, members in by_slot.items():
        h.addConstr(sum(model.work[t] * y[(t, s)] for t in members) - overflow[s] <= model.slots[s].capacity)
    per_rank_step: dict[tuple[int, int], list[int]] = {}
    for s in overflow:
        per_rank_step.setdefault((model.slots[s].rank, model.slots[s].step), []).append(s)
    for (_, step), members in per_rank_step.items():
        h.addConstr(sum(overflow[s] for s in members) - added[step] <= 0)
    for t, d in model.dependencies:
        same = model.rank[t] == model.rank[d]

        def position(task: int, same_rank: bool = same) -> Any:
            return sum(
                (model.slots[s].index if same_rank else model.slots[s].step) * y[(task, s)] for s in model.allowed(task)
            )

        h.addConstr(position(t) - position(d) >= 0)
    if start is not None:
        h.setSolution(_start_solution(highspy, h, model, start, y, overflow, added))
    h.setMinimize()
    h.run()
    status = h.modelStatusToString(h.getModelStatus())
    info = h.getInfo()
    if info.primal_solution_status != 2:  # no feasible point found within the time limit
        return math.inf, False, len(y)
    return info.objective_function_value, status == "Optimal", len(y)


def _start_solution(
    highspy: Any, h: Any, model: CycleModel, start: list[int], y: dict, overflow: dict, added: list
) -> Any:
    """The HiGHS solution of slots `start`: its binaries, overflows and steps' added times."""
    values = [0.0] * h.getNumCol()
    load: dict[int, float] = {}
    for t, s in enumerate(start):
        values[y[(t, s)].index] = 1.0
        load[s] = load.get(s, 0.0) + model.work[t]
    per_rank_step: dict[tuple[int, int], float] = {}
    for s, variable in overflow.items():
        values[variable.index] = over = max(0.0, load.get(s, 0.0) - model.slots[s].capacity)
        key = (model.slots[s].rank, model.slots[s].step)
        per_rank_step[key] = per_rank_step.get(key, 0.0) + over
    for (_, step), total in per_rank_step.items():
        values[added[step].index] = max(values[added[step].index], total)
    solution = highspy.HighsSolution()
    solution.col_value = values
    solution.value_valid = True
    return solution


def solve_cycle(
    schedule: Schedule,
    profile: Profile,
    rules: TaskRules,
    options: PackOptions | None = None,
    *,
    max_steps: int = 16,
    time_limit: float = 30.0,
    max_binaries: int = 20000,
) -> ExactResult:
    """The smallest k (from the packer's lower bound up to `max_steps`) whose least added time per
    step is within `options.max_overhead` of the first-order step, and that time (see the module
    docstring); each k's solve stops after `time_limit` seconds. ValueError naming
    `max_binaries` when a model at some k would need more binary variables than that."""
    options = options or PackOptions()
    started = time.perf_counter()
    prepared = _Prepared(schedule, profile, rules, options)
    first_order = prepared.first_order.step_time
    tried: list[tuple[int, float]] = []
    optimal, largest = True, 0
    for k in range(prepared.lower_bound, max(max_steps, prepared.lower_bound) + 1):
        model = cycle_model(prepared, k)
        binaries = sum(len(model.allowed(t)) for t in range(len(model.ops)))
        if binaries > max_binaries:
            raise ValueError(f"max_binaries: the model at k = {k} needs {binaries} binary variables (> {max_binaries})")
        total, proven, _ = least_added_time(model, time_limit, greedy_start(prepared, model))
        largest, optimal = max(largest, binaries), optimal and proven
        tried.append((k, total / k))
        if total / k <= options.max_overhead * first_order + TOLERANCE:
            break
    k, per_step = tried[-1]
    fits = per_step <= options.max_overhead * first_order + TOLERANCE
    return ExactResult(
        k, per_step, per_step / first_order, fits, optimal, tuple(tried), largest, time.perf_counter() - started
    )
