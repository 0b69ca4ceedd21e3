"""Greedy packer: place a refresh cycle's K-FAC tasks into the bubbles of a pipeline schedule.

The first-order timeline repeats every step, so each rank has the same free windows (bubbles,
less a safety margin) in every step. Tasks are placed window after window in time order over
the steps of the cycle, each where its dependencies allow; two strategies exist:

- ``fill`` (default): in each window, take the largest ready task that fits, then the next, so
  that big inverses use the big windows and small curvature tasks fill the rest; an inverse
  waits only for its own factor;
- ``published``: the PipeFisher reference's rule, for comparison: first fit in priority order
  (curvature A, curvature B, inverse A, inverse B); an inverse waits for all curvature of its
  kind on its rank; leftovers are appended after the last step.

The refresh interval k is the smallest one, not below the lower bound, whose packing overhead
(step time beyond first-order + preconditioning) stays within the budget. Tasks that fit no
window at all are unavoidable overhead: they go where they extend their step least and do not
raise k. Collective launches (factor syncs, inverse exchanges) take no rank time and are placed
in one order on all ranks of their group. Pure Python: no torch.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Literal

from pipefisher.ir import Op, OpKind, Schedule
from pipefisher.pack_report import DeviceReport, PackResult, device_reports
from pipefisher.plan import Plan, cycle_time, simulate_plan
from pipefisher.profile import Profile
from pipefisher.simulate import COLLECTIVES, Timeline, simulate
from pipefisher.tasks import KfacTasks, build_tasks, stage_replicas

__all__ = ["PackOptions", "PackResult", "DeviceReport", "pack", "after_step_plan", "STRATEGIES"]

Strategy = Literal["fill", "published"]
STRATEGIES = ("fill", "published")
_TOLERANCE = 1e-9
_PUBLISHED_PRIORITY = {OpKind.CURV_A: 0, OpKind.CURV_B: 1, OpKind.INV_A: 2, OpKind.INV_B: 3}


@dataclass(frozen=True)
class PackOptions:
    """`margin`: share of each bubble kept free (0..1); `max_overhead`: budget as a share of the
    first-order step time; `refresh_steps`: pin k instead of choosing it; `data_parallel`: copies
    of the pipeline (factors are synced over them too)."""

    margin: float = 0.05
    max_overhead: float = 0.01
    split: bool = True
    strategy: Strategy = "fill"
    refresh_steps: int | None = None
    max_refresh_steps: int = 256
    data_parallel: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.margin < 1:
            raise ValueError(f"margin: {self.margin} must be in [0, 1)")
        if self.max_overhead < 0:
            raise ValueError(f"max_overhead: {self.max_overhead} must be >= 0")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy: {self.strategy!r} is not one of {', '.join(STRATEGIES)}")
        if self.refresh_steps is not None and self.refresh_steps < 1:
            raise ValueError(f"refresh_steps: {self.refresh_steps} must be at least 1")
        if self.data_parallel < 1:
            raise ValueError(f"data_parallel: {self.data_parallel} must be at least 1")


@dataclass
class _Window:
    """Free time of one rank in one step: tasks go from `cursor` up to `end` (margin excluded)."""

    rank: int
    step: int
    start: float
    end: float
    cursor: float
    local_start: float

    @property
    def free(self) -> float:
        return max(0.0, self.end - self.cursor)


@dataclass
class _Placement:
    """Where an op sits: `step`, sort `key` within the rank's step list, global start/end times."""

    step: int
    key: tuple
    start: float
    end: float


class _Packer:
    """One packing of `tasks` into the windows of `first_order` (see the module docstring)."""

    def __init__(self, tasks: KfacTasks, first_order: Timeline, options: PackOptions):
        self.tasks = tasks
        self.options = options
        self.published = options.strategy == "published"
        self.schedule: Schedule = tasks.schedule
        self.first_order = first_order
        self.period = first_order.step_time
        self.durations = tasks.durations
        self.graph = tasks.graph
        self.fo_start = {iv.op: iv.start for ivs in first_order.ranks for iv in ivs}
        self.fo_end = {iv.op: iv.end for ivs in first_order.ranks for iv in ivs}
        self.template = self._window_template()
        self.precondition_keys = self._reserve_preconditions()

    # -- windows -----------------------------------------------------------------------------
    def _window_template(self) -> list[list[tuple[float, float]]]:
        """Per rank, its bubbles of one step as (start, usable end)."""
        margin = self.options.margin
        return [
            [(b.start, b.end - margin * b.duration) for b in self.first_order.bubbles(rank)]
            for rank in range(self.schedule.num_ranks)
        ]

    def _reserve_preconditions(self) -> dict[Op, tuple[float, float | None]]:
        """Put each rank's per-step preconditions in the first window after its stage's last
        backward (the same in every step); returns op -> (start, window start or None = tail)."""
        last_backward: dict[tuple[int, int], float] = {}
        for ivs in self.first_order.ranks:
            for iv in ivs:
                if iv.op.kind is OpKind.BACKWARD:
                    key = (iv.op.pipe, iv.op.stage)
                    last_backward[key] = max(last_backward.get(key, 0.0), iv.end)
        reserved: dict[Op, tuple[float, float | None]] = {}
        for rank, ops in enumerate(self.tasks.per_step):
            windows = self.template[rank]
            for op in sorted(ops, key=lambda o: last_backward[(o.pipe, o.stage)]):
                work = self.durations(op)
                release = last_backward[(op.pipe, op.stage)]
                for index, (start, end) in enumerate(windows):
                    if start >= release - _TOLERANCE and end - start >= work - _TOLERANCE:
                        reserved[op] = (start, start)
                        windows[index] = (start + work, end)
                        break
                else:
                    reserved[op] = (math.inf, None)
        return reserved

    def _windows(self, step: int) -> list[_Window]:
        offset = step * self.period
        return [
            _Window(rank, step, offset + start, offset + end, offset + start, start)
            for rank, windows in enumerate(self.template)
            for start, end in windows
            if end - start > _TOLERANCE
        ]

    # -- the greedy ---------------------------------------------------------------------------
    def _extra_dependencies(self) -> dict[Op, list[Op]]:
        """The published rule: an inverse waits for all curvature of its kind on its rank."""
        if not self.published:
            return {}
        extra: dict[Op, list[Op]] = {}
        for ops in self.tasks.cycle:
            curvature = {OpKind.INV_A: [o for o in ops if o.kind is OpKind.CURV_A], OpKind.INV_B: [o for o in ops if o.kind is OpKind.CURV_B]}
            for op in ops:
                if op.kind in curvature:
                    extra[op] = curvature[op.kind]
        return extra

    def _priority(self, op: Op, index: int) -> tuple:
        if self.published:
            return (_PUBLISHED_PRIORITY.get(op.kind, 9), index)
        return (index,)

    def run(self, max_steps: int) -> dict[Op, _Placement]:
        """Place cycle tasks over up to `max_steps` steps; unplaced tasks are absent."""
        rank_of = {op: rank for rank, ops in enumerate(self.tasks.cycle) for op in ops}
        order = {op: self._priority(op, i) for ops in self.tasks.cycle for i, op in enumerate(ops)}
        extra = self._extra_dependencies()
        deps = {op: list(self.graph.dependencies(op)) + extra.get(op, []) for op in rank_of}
        dependents: dict[Op, list[Op]] = defaultdict(list)
        missing: dict[Op, int] = {}
        release: dict[Op, float] = {}
        for op, op_deps in deps.items():
            cycle_deps = [d for d in op_deps if d in rank_of]
            missing[op] = len(cycle_deps)
            for dep in cycle_deps:
                dependents[dep].append(op)
            # Curvature waits for its forward/backward of the first step.
            release[op] = max((self.fo_end[d] for d in op_deps if d not in rank_of), default=0.0)
        end_of: dict[Op, float] = {}
        placed: dict[Op, _Placement] = {}
        pending: list[list[tuple[float, tuple, Op]]] = [[] for _ in range(self.schedule.num_ranks)]
        ready: list[list[tuple]] = [[] for _ in range(self.schedule.num_ranks)]
        sequence = 0

        def finish(op: Op, end: float) -> None:
            end_of[op] = end
            for child in dependents[op]:
                release[child] = max(release[child], end + self.durations.delay(op, child, rank_of[op] != rank_of[child]))
                missing[child] -= 1
                if missing[child] == 0:
                    make_ready(child)

        def make_ready(op: Op) -> None:
            if op.kind in COLLECTIVES:  # an asynchronous launch: no rank time, no window
                placed[op] = _Placement(step=-1, key=(), start=release[op], end=release[op])
                finish(op, release[op])
            else:
                heapq.heappush(pending[rank_of[op]], (release[op], order[op], op))

        for op in rank_of:
            if missing[op] == 0:
                make_ready(op)

        for step in range(max_steps):
            placed_before = len(placed)
            for window in sorted(self._windows(step), key=lambda w: (w.start, w.rank)):
                rank = window.rank
                while True:
                    queue = pending[rank]
                    while queue and queue[0][0] <= window.cursor + _TOLERANCE:
                        _, prio, op = heapq.heappop(queue)
                        bisect.insort(ready[rank], self._ready_key(op, prio))
                    choice = self._choose(ready[rank], window.free)
                    if choice is None:
                        if queue and queue[0][0] < window.end:
                            window.cursor = queue[0][0]
                            continue
                        break
                    op = choice[-1]
                    work = self.durations(op)
                    sequence += 1
                    placed[op] = _Placement(step, (step, window.local_start, 1, sequence, 0), window.cursor, window.cursor + work)
                    window.cursor += work
                    finish(op, window.cursor)
            if len(placed) == len(rank_of):
                break
            step_end = (step + 1) * self.period
            if len(placed) == placed_before and not any(q and q[0][0] >= step_end for q in pending):
                break  # what is left fits no window
        return placed

    def _ready_key(self, op: Op, prio: tuple) -> tuple:
        if self.published:
            return (prio, op)
        return (self.durations(op), tuple(-p for p in prio), op)

    def _choose(self, ready: list[tuple], free: float) -> tuple | None:
        """Remove and return the ready entry to place in `free` time, or None."""
        if self.published:
            for index, entry in enumerate(ready):
                if self.durations(entry[-1]) <= free + _TOLERANCE:
                    return ready.pop(index)
            return None
        index = bisect.bisect_right(ready, (free + _TOLERANCE, (math.inf,)))
        return ready.pop(index - 1) if index > 0 else None

    def precondition_in_bubbles(self, rank: int) -> float:
        """Per-step precondition time of `rank` that sits inside its bubbles."""
        return sum(self.durations(op) for op in self.tasks.per_step[rank] if self.precondition_keys[op][1] is not None)

    def lower_bounds(self) -> list[int]:
        """Per rank: ceil(cycle work / bubble time left after the preconditions that sit in
        bubbles), tasks longer than every bubble excluded; at least 1."""
        bounds = []
        for rank in range(self.schedule.num_ranks):
            longest = max((end - start for start, end in self.template[rank]), default=0.0)
            work = sum(w for w in map(self.durations, self.tasks.cycle[rank]) if w <= longest + _TOLERANCE)
            spare = self.first_order.bubble_time(rank) - self.precondition_in_bubbles(rank)
            bounds.append(max(1, math.ceil(work / spare - 1e-9)) if spare > _TOLERANCE else 1)
        return bounds

    # -- plans --------------------------------------------------------------------------------
    @property
    def leftover_policies(self) -> tuple[str, ...]:
        return ("tail",) if self.published else ("spread", "tail")

    def plan(self, placed: dict[Op, _Placement], refresh_steps: int, policy: str) -> tuple[Plan, list[Op]]:
        """Plan with `refresh_steps` steps; tasks placed later (or never) are leftovers, appended
        after the last step (`tail`) or spread where they extend their steps least (`spread`).
        Returns the plan and its leftovers."""
        kept = {op: p for op, p in placed.items() if op.kind not in COLLECTIVES and p.step < refresh_steps}
        leftovers = sorted(
            (op for ops in self.tasks.cycle for op in ops if op.kind not in COLLECTIVES and op not in kept),
            key=self._topological_key,
        )
        if policy == "tail":
            self._append_leftovers(kept, leftovers, refresh_steps)
        else:
            self._spread_leftovers(kept, leftovers, refresh_steps)
        self._place_collectives(kept)
        steps = []
        for step in range(refresh_steps):
            step_ranks = []
            for rank, compute in enumerate(self.schedule.ranks):
                items = [((step, self.fo_start[op], 0, 0, 0), op) for op in compute]
                for op in self.tasks.per_step[rank]:
                    start, window = self.precondition_keys[op]
                    items.append(((step, window if window is not None else math.inf, 1, -1, 0), op))
                step_ranks.append(items)
            steps.append(step_ranks)
        for op, placement in kept.items():
            steps[placement.step][self.schedule.placement[(op.pipe, op.stage)]].append((placement.key, op))
        ranks = tuple(tuple(tuple(op for _, op in sorted(items, key=lambda item: item[0])) for items in step) for step in steps)
        return Plan(schedule=self.schedule, steps=ranks), leftovers

    def _append_leftovers(self, kept: dict[Op, _Placement], leftovers: list[Op], refresh_steps: int) -> None:
        """Run leftovers after the last step's own work, in dependency order."""
        last = refresh_steps - 1
        end_of = {op: p.end for op, p in kept.items()}
        tail: dict[int, float] = defaultdict(float)
        for sequence, op in enumerate(leftovers):
            rank = self.schedule.placement[(op.pipe, op.stage)]
            start = max(self._leftover_release(op, end_of), (last + 1) * self.period + tail[rank])
            tail[rank] = start + self.durations(op) - (last + 1) * self.period
            kept[op] = _Placement(last, (last, math.inf, 2, sequence, 0), start, start + self.durations(op))
            end_of[op] = kept[op].end

    def _spread_leftovers(self, kept: dict[Op, _Placement], leftovers: list[Op], refresh_steps: int) -> None:
        """Put each leftover where it raises its step's largest per-rank extension least (ranks
        extend in parallel); an extension is the part of a task its window's free time lacks."""
        last = refresh_steps - 1
        end_of = {op: p.end for op, p in kept.items()}
        windows: dict[int, list[_Window]] = defaultdict(list)
        by_step: dict[tuple[int, int], list[_Window]] = defaultdict(list)
        for step in range(refresh_steps):
            for window in self._windows(step):
                windows[window.rank].append(window)
                by_step[(window.rank, step)].append(window)
        for op, placement in kept.items():  # consume what the greedy used
            for window in by_step[(self.schedule.placement[(op.pipe, op.stage)], placement.step)]:
                if window.start <= placement.start + _TOLERANCE < window.end:
                    window.cursor = max(window.cursor, placement.end)
        extension: dict[tuple[int, int], float] = defaultdict(float)
        step_max: dict[int, float] = defaultdict(float)
        tail: dict[tuple[int, int], float] = defaultdict(float)
        for sequence, op in enumerate(leftovers):
            rank = self.schedule.placement[(op.pipe, op.stage)]
            work = self.durations(op)
            ready = self._leftover_release(op, end_of)
            candidates: list[tuple[float, int, _Window | None]] = [
                (max(0.0, work - window.free), window.step, window)
                for window in windows[rank]
                if window.start + _TOLERANCE >= ready
            ]
            candidates += [(work, step, None) for step in range(refresh_steps) if (step + 1) * self.period >= ready or step == last]
            added, step, window = min(
                candidates,
                key=lambda c: (max(0.0, extension[(rank, c[1])] + c[0] - step_max[c[1]]), c[0], c[1]),
            )
            extension[(rank, step)] += added
            step_max[step] = max(step_max[step], extension[(rank, step)])
            if window is not None:
                start = max(window.cursor, ready)
                key = (step, window.local_start, 1, 10**9 + sequence, 0)
                window.cursor = window.end
            else:
                start = max(ready, (step + 1) * self.period + tail[(rank, step)])
                tail[(rank, step)] += work
                key = (step, math.inf, 2, sequence, 0)
            kept[op] = _Placement(step, key, start, start + work)
            end_of[op] = kept[op].end

    def _topological_key(self, op: Op) -> tuple:
        phase = {OpKind.CURV_A: 0, OpKind.CURV_B: 0, OpKind.INV_A: 1, OpKind.INV_B: 1}.get(op.kind, 2)
        return (phase, self.schedule.placement[(op.pipe, op.stage)], op.stage, op.layer or "", op.kind.value, op.micro_batch or 0)

    def _leftover_release(self, op: Op, end_of: dict[Op, float]) -> float:
        """Earliest global start of `op` given placed tasks (collectives resolved through)."""
        ready = 0.0
        for dep in self.graph.dependencies(op):
            if dep.kind in COLLECTIVES:
                launch = max((end_of.get(d, 0.0) for d in self.graph.dependencies(dep)), default=0.0)
                ready = max(ready, launch + self.durations.work(dep))
            elif dep in end_of:
                ready = max(ready, end_of[dep])
            elif dep.kind.is_compute:
                ready = max(ready, self.fo_end[dep])
        return ready

    def _place_collectives(self, kept: dict[Op, _Placement]) -> None:
        """Launch every collective right after its own dependencies, in one order per group:
        syncs first, then exchanges (which wait for every replica's syncs of their layer)."""
        collectives = [op for ops in self.tasks.cycle for op in ops if op.kind in COLLECTIVES]
        last_key: dict[frozenset[int], dict[int, tuple]] = defaultdict(dict)
        for kinds in ({OpKind.SYNC_A, OpKind.SYNC_B}, {OpKind.EXCHANGE}):
            self._place_collectives_of([op for op in collectives if op.kind in kinds], kept, last_key)

    def _place_collectives_of(self, collectives: list[Op], kept: dict[Op, _Placement], last_key: dict[frozenset[int], dict[int, tuple]]) -> None:
        """Place `collectives` after their dependencies' final places; `last_key[group][rank]`: the
        place of the group's last collective on that rank so far (updated)."""
        if not collectives:
            return
        replicas = stage_replicas(self.schedule)
        group_of = {stage: frozenset(self.schedule.placement[(p, stage)] for p in pipes) for stage, pipes in replicas.items()}
        own: dict[Op, tuple[float, tuple]] = {}
        for op in collectives:
            deps = [kept[d] for d in self.graph.dependencies(op) if d in kept]
            if deps:
                last = max(deps, key=lambda p: p.key)
                own[op] = (max(p.end for p in deps), last.key)
            else:
                own[op] = (0.0, (0, -math.inf, 0, 0, 0))
        by_collective: dict[tuple, list[Op]] = defaultdict(list)
        for op in collectives:
            by_collective[(op.kind, op.stage, op.layer)].append(op)
        groups: dict[frozenset[int], list[tuple]] = defaultdict(list)
        for key, members in by_collective.items():
            ready = max(own[m][0] for m in members)
            groups[group_of[key[1]]].append((ready, key[0] is OpKind.EXCHANGE, key[1], key[2], key[0].value, members))
        for group, entries in groups.items():
            group_last = last_key[group]
            for *_, members in sorted(entries, key=lambda e: e[:5]):
                for op in members:
                    rank = self.schedule.placement[(op.pipe, op.stage)]
                    base = max(own[op][1], group_last.get(rank, own[op][1]))
                    key = base[:4] + (base[4] + 1,)
                    group_last[rank] = key
                    kept[op] = _Placement(key[0], key, own[op][0], own[op][0])


@dataclass(frozen=True)
class _Candidate:
    cycle_time: float
    plan: Plan
    timelines: list[Timeline]
    leftovers: list[Op]


def pack(schedule: Schedule, profile: Profile, options: PackOptions | None = None) -> PackResult:
    """Pack the K-FAC work of `schedule` (with `profile`'s layers and times) into its bubbles."""
    options = options or PackOptions()
    tasks = build_tasks(schedule, profile, split=options.split, data_parallel=options.data_parallel)
    first_order = simulate(schedule, profile)
    cycle_ops = [op for ops in tasks.cycle for op in ops if op.kind not in COLLECTIVES]
    packer = _Packer(tasks, first_order, options)
    placed = packer.run(options.max_refresh_steps)
    natural = 1 + max((placed[op].step for op in cycle_ops if op in placed), default=0)
    bounds = packer.lower_bounds()
    lower_bound = max(bounds)
    precondition_only = _precondition_step_time(packer, tasks)
    step_cache: dict = {}

    def best_at(k: int) -> _Candidate:
        """The plan with k steps whose leftover policy gives the least cycle time."""
        candidates = []
        for policy in packer.leftover_policies:
            plan, leftovers = packer.plan(placed, k, policy)
            timelines = simulate_plan(plan, tasks.durations, step_cache)
            candidates.append(_Candidate(cycle_time(timelines), plan, timelines, leftovers))
        return min(candidates, key=lambda c: c.cycle_time)

    if options.refresh_steps is not None:
        chosen = best_at(options.refresh_steps)
    elif options.strategy == "published":
        chosen = best_at(natural)
    else:
        # Work that fits no window costs the same whatever k: only the rest counts against the budget.
        longest = max(natural, lower_bound)
        chosen = best_at(longest)
        unavoidable = chosen.cycle_time - longest * precondition_only
        for k in range(lower_bound, longest):
            candidate = best_at(k)
            avoidable = candidate.cycle_time - k * precondition_only - unavoidable
            if avoidable / (k * first_order.step_time) <= options.max_overhead:
                chosen = candidate
                break
    return PackResult(
        plan=chosen.plan,
        timelines=chosen.timelines,
        first_order=first_order,
        precondition_step_time=precondition_only,
        lower_bound=lower_bound,
        devices=device_reports(packer.tasks, packer.first_order, chosen.plan, chosen.leftovers, packer.precondition_in_bubbles, bounds),
        options=options,
        unplaceable=tuple(op for op in cycle_ops if op not in placed),
    )


def _precondition_step_time(packer: _Packer, tasks: KfacTasks) -> float:
    """Step time with preconditioning as the only K-FAC work."""
    ranks = []
    for rank, compute in enumerate(tasks.schedule.ranks):
        items = [((packer.fo_start[op], 0), op) for op in compute]
        for op in tasks.per_step[rank]:
            _, window = packer.precondition_keys[op]
            items.append(((window if window is not None else math.inf, 1), op))
        ranks.append(tuple(op for _, op in sorted(items, key=lambda item: item[0])))
    plan = Plan(schedule=tasks.schedule, steps=(tuple(ranks),))
    return simulate_plan(plan, tasks.profile)[0].step_time


def after_step_plan(schedule: Schedule, profile: Profile, refresh_steps: int, split: bool = True, data_parallel: int = 1) -> Plan:
    """The naive placement, for comparison: all of a cycle's K-FAC work in one block after the
    flush of its first step (curvature, syncs, inverses, exchanges), preconditioning at the end of
    every step. Collectives go in one order on every rank (by stage, layer, kind)."""
    tasks = build_tasks(schedule, profile, split=split, data_parallel=data_parallel)
    layer_index = {(stage, layer.name): i for stage, sp in enumerate(profile.stages) for i, layer in enumerate(sp.layers)}

    def block(ops: tuple[Op, ...]) -> list[Op]:
        compute = [op for op in ops if op.kind not in COLLECTIVES and op.kind not in (OpKind.INV_A, OpKind.INV_B)]
        collectives = lambda kinds: sorted(
            (op for op in ops if op.kind in kinds), key=lambda op: (op.stage, layer_index[(op.stage, op.layer)], op.kind.value)
        )
        inverses = [op for op in ops if op.kind in (OpKind.INV_A, OpKind.INV_B)]
        return compute + collectives({OpKind.SYNC_A, OpKind.SYNC_B}) + inverses + collectives({OpKind.EXCHANGE})

    steps = []
    for step in range(refresh_steps):
        ranks = []
        for rank, compute in enumerate(schedule.ranks):
            work = block(tasks.cycle[rank]) if step == 0 else []
            ranks.append(tuple(compute) + tuple(work) + tasks.per_step[rank])
        steps.append(tuple(ranks))
    return Plan(schedule=schedule, steps=tuple(steps))
