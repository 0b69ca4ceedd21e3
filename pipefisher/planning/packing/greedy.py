"""Greedy placement of a refresh cycle's curvature tasks into the bubbles of repeated steps.

The first-order timeline repeats every step, so each rank has the same windows in every step: the
bubbles of a step with its preconditioning (each precondition in the first bubble after its
stage's last backward that holds it), less `margin` of each. Windows are visited in time order over the
steps; in each, ready tasks are placed one after another:

- ``fill``: the largest ready task that fits, so that big inverses take the big windows and small
  curvature tasks fill the rest;
- ``published``: the PipeFisher reference's rule: the first task that fits in priority order
  (curvature of part 0, of part 1, refresh work of part 0, of part 1: K-FAC's curvature A, B,
  inverse A, B); a part's refresh work waits for all curvature of its part on its rank.

Where the schedule splits the backward, weight gradients (W ops) stay where it put them
(policy ``fixed``), or move within their step as `pipefisher.planning.packing.weights` bounds them: the
windows then include the W ops' own time, and in every step each rank's W ops are placed in
order, never later than their latest start, before it (``first``: as soon as ready) or when no
ready task fits before that (``last``).

Collective launches (factor syncs, inverse exchanges) take no rank time: they happen once their
own dependencies are done. Times are global: step j spans [j * T, (j + 1) * T), T the step time
with preconditioning.
Pure Python: no torch.
"""

from __future__ import annotations

import bisect
import heapq
import math
from typing import Literal

from pipefisher.core.ir import Op, OpKind
from pipefisher.planning.packing.weights import WeightPolicy
from pipefisher.planning.packing.windows import TOLERANCE, Placed, Placement, Slot, Windows
from pipefisher.planning.simulate import COLLECTIVES, Timeline
from pipefisher.planning.tasks import CurvatureTasks

Strategy = Literal["fill", "published"]
STRATEGIES = ("fill", "published")
CURVATURE_KINDS = frozenset({OpKind.CURVATURE})
#: builds a named tuple from a tuple without its Python-level constructor (the greedy's hot path)
_new = tuple.__new__
#: the published rule's order: curvature of each part, then refresh work of each part
_PUBLISHED_PHASE = {OpKind.CURVATURE: 0, OpKind.REFRESH: 1}


def place(
    tasks: CurvatureTasks,
    first_order: Timeline,
    windows: Windows,
    strategy: Strategy,
    max_steps: int,
    curvature_until: int | None = None,
    weights: WeightPolicy = "fixed",
) -> Placed:
    """Place the cycle's tasks over up to `max_steps` steps; tasks left unplaced are absent.
    Curvature is placed only in steps <= `curvature_until` when given. `weights`: how W ops are
    placed (see the module docstring; ``fixed`` where the schedule has none)."""
    return Greedy(tasks, first_order, windows, strategy, weights).run(max_steps, curvature_until)


class Greedy:
    """The greedy over *units*: a unit is one task, or the curvature chain of one factor of one
    layer (its micro-batches in order, each after the previous one). Only a chain's next task is
    ready at a time, so placing a chain's tasks one after another while they stay the best choice
    is the same as choosing task by task, at a fraction of the cost. Units are numbered in
    `tasks.cycle` order of their first task (a topological order). Built once per task set,
    strategy and weight policy; each `run` is one independent pass (it resets all it changes), so
    runs with other horizons or curvature limits reuse the units and their dependencies."""

    #: per unit: its tasks, their work and cycle index (the tie-break), its rank, whether it is a
    #: curvature chain or a collective, and per task when its first-step input is ready
    ops: list[list[Op]]
    work: list[list[float]]
    index: list[list[int]]
    unit_of: dict[Op, int]
    rank: list[int]
    curvature: list[bool]
    collective: list[bool]
    op_release: list[list[float]]
    #: per unit: the units waiting for it, with their delay, and how many units it waits for
    children: list[list[tuple[int, float]]]
    parents: list[int]

    def __init__(
        self,
        tasks: CurvatureTasks,
        first_order: Timeline,
        windows: Windows,
        strategy: Strategy,
        weights: WeightPolicy,
        like: Greedy | None = None,
    ):
        """`like`: a greedy of the same tasks and first-order timeline (another strategy or weight
        policy) whose units, and dependencies where its strategy is the same, are taken as they are."""
        if windows.weights is None:
            weights = "fixed"
        self.published = strategy == "published"
        self.windows = windows
        #: the W ops' bounds when they move (None: fixed), and whether they go first
        self.movable = windows.weights if weights != "fixed" else None
        self.weights_first = weights == "first"
        self.period = windows.preconditioned.step_time  # a step with its preconditioning
        if like is None:
            self._build_units(tasks, first_order)
        else:
            self.ops, self.work, self.index, self.unit_of = like.ops, like.work, like.index, like.unit_of
            self.rank, self.curvature, self.collective = like.rank, like.curvature, like.collective
            self.op_release = like.op_release
        if like is not None and like.published == self.published:
            self.children, self.parents = like.children, like.parents
        else:
            self._build_dependencies(tasks)

    def _build_units(self, tasks: CurvatureTasks, first_order: Timeline) -> None:
        """The units of `tasks.cycle` and their tasks' releases on the `first_order` timeline."""
        self.ops, self.unit_of, self.work, self.index = [], {}, [], []
        chains: dict[tuple | Op, int] = {}
        all_ops = (op for ops in tasks.cycle for op in ops)
        for index, (op, work) in enumerate(zip(all_ops, (w for works in tasks.cycle_work for w in works))):
            key = (op.kind, op.part, op.pipe, op.stage, op.layer) if op.kind in CURVATURE_KINDS else op
            unit = chains.setdefault(key, len(self.ops))
            if unit == len(self.ops):
                self.ops.append([])
                self.work.append([])
                self.index.append([])
            self.ops[unit].append(op)
            self.work[unit].append(work)
            self.index[unit].append(index)
            self.unit_of[op] = unit
        placement = tasks.schedule.placement
        self.rank = [placement[(ops[0].pipe, ops[0].stage)] for ops in self.ops]
        self.curvature = [ops[0].kind in CURVATURE_KINDS for ops in self.ops]
        self.collective = [ops[0].kind in COLLECTIVES for ops in self.ops]
        fo_end = {iv.op: iv.end for intervals in first_order.ranks for iv in intervals}
        self.op_release = [
            [max((fo_end[dep] for dep in tasks.graph.first_step_inputs(op)), default=0.0) for op in ops]
            for ops in self.ops
        ]

    def _build_dependencies(self, tasks: CurvatureTasks) -> None:
        """Per unit, the units waiting for it with their delay (`children`), and how many units
        it waits for (`parents`, before a run places any)."""
        unit_of, delay, rank = self.unit_of, tasks.durations.delay, self.rank
        extra = self._published_dependencies(tasks) if self.published else {}
        children: list[dict[int, float]] = [{} for _ in self.ops]
        #: id of an `extra` tuple (shared by a rank's refresh ops of a part) -> its (unit, op) pairs
        extra_units: dict[int, list[tuple[int, Op]]] = {}
        for unit, ops in enumerate(self.ops):
            if self.curvature[unit]:
                continue  # a chain waits for its first-step inputs (op_release) and itself only
            for op in ops:
                parents: dict[int, Op] = {}
                for dep in tasks.graph.dependencies(op):
                    if (parent := unit_of.get(dep)) is not None:
                        parents[parent] = dep
                extra_deps = extra.get(op)
                if extra_deps:  # (as if its deps were listed after the graph's, resolved once per tuple)
                    pairs = extra_units.get(id(extra_deps))
                    if pairs is None:
                        pairs = extra_units[id(extra_deps)] = [
                            (parent, dep) for dep in extra_deps if (parent := unit_of.get(dep)) is not None
                        ]
                    parents.update(pairs)
                parents.pop(unit, None)
                own_rank = rank[unit]
                for parent, dep in parents.items():  # (a chain's tasks all pass on the same delay)
                    waiting = children[parent]
                    waiting[unit] = max(waiting.get(unit, 0.0), delay(dep, op, own_rank != rank[parent]))
        self.children = [list(found.items()) for found in children]
        self.parents = [0] * len(self.ops)
        for found in self.children:
            for child, _ in found:
                self.parents[child] += 1

    @staticmethod
    def _published_dependencies(tasks: CurvatureTasks) -> dict[Op, tuple[Op, ...]]:
        """The published rule: a part's refresh work waits for all curvature of its part on its
        rank, i.e. for the last task of each of its rank's curvature chains of that part."""
        extra: dict[Op, tuple[Op, ...]] = {}
        for ops in tasks.cycle:
            curvature = [op for op in ops if op.kind in CURVATURE_KINDS]
            earlier = {dep for op in curvature for dep in tasks.graph.dependencies(op) if dep.kind is op.kind}
            last: dict[int | None, tuple[Op, ...]] = {}
            for op in curvature:
                if op not in earlier:
                    last[op.part] = last.get(op.part, ()) + (op,)
            extra.update(
                {op: last.get(op.part, ()) for op in ops if op.kind is OpKind.REFRESH and tasks.rules.curvature}
            )
        return extra

    def run(self, max_steps: int, curvature_until: int | None = None) -> Placed:
        """One pass over up to `max_steps` steps, curvature only in steps <= `curvature_until`
        where given (see `place`)."""
        num_ranks = len(self.windows.free)
        self.head = [0] * len(self.ops)
        self.release = [0.0] * len(self.ops)
        self.missing = list(self.parents)
        self.pending: list[list[tuple]] = [[] for _ in range(num_ranks)]  # (release, unit)
        self.ready: list[list[tuple]] = [[] for _ in range(num_ranks)]
        self.placed: dict[Op, Placement] = {}
        self.sequence = 0  # placements so far (the order within a window)
        #: per step, the W ops placed in it (when they move); per rank, the next W of the step
        self.weights_placed: list[dict[Op, Placement]] = []
        self.weight_head = [0] * num_ranks
        self.done = 0
        self.step = 0
        self.curvature_until = math.inf if curvature_until is None else curvature_until
        for unit in [
            unit for unit in range(len(self.ops)) if self.missing[unit] == 0
        ]:  # (launching one readies others)
            self._make_ready(unit)
        free = self.windows.free if self.movable is None else self.movable.free
        order = sorted((start, rank, end) for rank, windows in enumerate(free) for start, end in windows)
        for step in range(max_steps):
            self.step = step
            if step > self.curvature_until:
                self._drop_curvature()
            done_before = len(self.placed)
            offset = step * self.period
            if self.movable is not None:
                self.weights_placed.append({})
                self.weight_head = [0] * num_ranks
            for local_start, rank, local_end in order:
                self._fill(rank, step, local_start, offset + local_start, offset + local_end)
            if self.movable is not None and self.weight_head != [len(ops) for ops in self.movable.ops]:
                raise AssertionError(f"step {step}: weight gradients left unplaced")  # the bounds guarantee room
            if self.done == len(self.ops):
                break
            step_end = (step + 1) * self.period
            if (
                len(self.placed) == done_before
                and not any(q and q[0][0] >= step_end for q in self.pending)
                and not self._anything_fits()
            ):
                break  # what is left fits no window
        return Placed(self.placed, tuple(self.weights_placed))

    def _next_weight(self, rank: int, offset: float) -> tuple[float, float, float] | None:
        """(global release, global latest start, work) of `rank`'s next W of the step; None if W
        ops are fixed or all placed."""
        movable = self.movable
        if movable is None:
            return None
        head = self.weight_head[rank]
        if head == len(movable.ops[rank]):
            return None
        return offset + movable.release[rank][head], offset + movable.latest[rank][head], movable.work[rank][head]

    def _place_weight(self, rank: int, step: int, local_start: float, cursor: float) -> float:
        """Place `rank`'s next W of `step` at `cursor` in the window at `local_start`; its end."""
        movable, head = self.movable, self.weight_head[rank]
        assert movable is not None, "W ops are placed only when they move"
        end = cursor + movable.work[rank][head]
        slot = _new(Slot, (step, local_start, 1, self.sequence, 0))
        self.weights_placed[step][movable.ops[rank][head]] = _new(Placement, (slot, cursor, end))
        self.sequence += 1
        self.weight_head[rank] = head + 1
        return end

    def _fill(self, rank: int, step: int, local_start: float, cursor: float, end: float) -> None:
        """Place ready work of `rank` in the window [cursor, end) of `step`: tasks, and its W ops
        when they move (no task crosses the next W's latest start; that W runs by then)."""
        pending, ready, placed = self.pending[rank], self.ready[rank], self.placed
        offset = step * self.period
        while True:
            while pending and pending[0][0] <= cursor + TOLERANCE:
                bisect.insort(ready, self._ready_key(heapq.heappop(pending)[1]))
            weight = self._next_weight(rank, offset)
            limit = end if weight is None else min(end, weight[1])
            chosen = self._best(ready, limit - cursor)
            if (
                weight is not None
                and weight[0] <= cursor + TOLERANCE
                and cursor + weight[2] <= end + TOLERANCE
                and (chosen is None or self.weights_first)
            ):
                cursor = self._place_weight(rank, step, local_start, cursor)
                continue
            if chosen is None:
                waiting = weight is not None and weight[0] > cursor + TOLERANCE  # (else it fits a later window)
                upcoming = min(
                    pending[0][0] if pending else math.inf, weight[0] if weight is not None and waiting else math.inf
                )
                if upcoming < end:
                    cursor = upcoming
                    continue
                return
            unit = ready.pop(chosen)[-1]
            ops, work, releases = self.ops[unit], self.work[unit], self.op_release[unit]
            head = self.head[unit]
            while True:  # the chain's tasks while each is still the best choice
                slot = _new(Slot, (step, local_start, 1, self.sequence, 0))
                self.sequence += 1
                placed[ops[head]] = _new(Placement, (slot, cursor, cursor + work[head]))
                cursor += work[head]
                head += 1
                if head == len(ops) or releases[head] > cursor + TOLERANCE or cursor + work[head] > limit + TOLERANCE:
                    break
                if pending and pending[0][0] <= cursor + TOLERANCE:
                    break  # newly ready work competes
                if weight is not None and self.weights_first and weight[0] <= cursor + TOLERANCE:
                    break  # the next W is ready and goes first
                if work[head] != work[head - 1]:  # (an equal next task stays the best choice)
                    rival = self._best(ready, limit - cursor)
                    if rival is not None and ready[rival][:-1] > self._key(unit, head):
                        break
            self.head[unit] = head
            if head == len(ops):
                self._finish(unit, cursor)
            elif releases[head] > cursor + TOLERANCE:
                heapq.heappush(pending, (releases[head], unit))
            else:
                bisect.insort(ready, self._ready_key(unit))

    def _anything_fits(self) -> bool:
        """Whether some ready or pending task fits a window of its rank (it may yet be placed)."""
        return any(
            self.work[entry[-1]][self.head[entry[-1]]] <= self.windows.longest(rank) + TOLERANCE
            for rank in range(len(self.windows.free))
            for entry in self.ready[rank] + self.pending[rank]
        )

    def _finish(self, unit: int, end: float) -> None:
        self.done += 1
        release, missing = self.release, self.missing
        for child, delay in self.children[unit]:
            ready = end + delay
            if ready > release[child]:  # (max(release, ready), as max picks it)
                release[child] = ready
            missing[child] -= 1
            if missing[child] == 0:
                self._make_ready(child)

    def _make_ready(self, unit: int) -> None:
        if self.collective[unit]:  # an asynchronous launch: no rank time, no window
            launch = max(self.release[unit], self.op_release[unit][0])
            for op in self.ops[unit]:
                self.placed[op] = Placement(Slot(-1, 0.0, 1, 0), launch, launch)
            self._finish(unit, launch)
        elif not (self.curvature[unit] and self.step > self.curvature_until):
            release = max(self.release[unit], self.op_release[unit][0])
            heapq.heappush(self.pending[self.rank[unit]], (release, unit))

    def _drop_curvature(self) -> None:
        """Past `curvature_until`: curvature (and all that waits for it) stays unplaced."""
        for queues in (self.pending, self.ready):
            for rank, queue in enumerate(queues):
                queues[rank] = [entry for entry in queue if not self.curvature[entry[-1]]]
        for queue in self.pending:
            heapq.heapify(queue)

    def _key(self, unit: int, head: int) -> tuple:
        """How good a choice the unit's task `head` is (larger: better): ``published``: its
        priority (kind order, then cycle order), reversed; ``fill``: its size, then cycle order."""
        op = self.ops[unit][head]
        index = self.index[unit][head]
        if self.published:
            phase = _PUBLISHED_PHASE.get(op.kind)
            return (-(9 if phase is None else 2 * phase + (op.part or 0)), -index)
        return (self.work[unit][head], -index)

    def _ready_key(self, unit: int) -> tuple:
        return self._key(unit, self.head[unit]) + (unit,)

    def _best(self, ready: list[tuple], free: float) -> int | None:
        """Index in `ready` of the unit whose next task goes into `free` time, or None:
        ``published``: the first in priority order that fits; ``fill``: the largest that fits
        (ties: the earliest in the cycle)."""
        if self.published:
            for index in range(len(ready) - 1, -1, -1):
                unit = ready[index][-1]
                if self.work[unit][self.head[unit]] <= free + TOLERANCE:
                    return index
            return None
        index = bisect.bisect_right(ready, (free + TOLERANCE, math.inf))
        return index - 1 if index > 0 else None
