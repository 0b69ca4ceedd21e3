"""Turn a greedy placement into a Plan with k steps: leftovers, collectives, per-rank op lists.

Tasks the greedy placed in step k or later (or never) are leftovers; a policy puts them:
``tail`` after the last step's own work, in dependency order; ``spread`` where each extends its
step least (ranks extend in parallel); ``eager`` (curvature only) right after its latest
dependency, in step 0 or wherever that is, so its capture is freed at once. Collectives are then
launched right after their own dependencies, in one order on every rank of their group.
Weight gradients (W ops) run where the schedule put them, except in the steps where the greedy
moved them (`Placed.weights`) and placed cycle tasks in the windows: there they run where it put
them, and leftovers spread into that step use its windows with the W ops' time.
Every op's slot follows those of all it waits for on its rank, by construction (`_EAGER`,
`_place_eagerly`, `_spread`, `_place_collectives_of`): a plan that deadlocks is a bug, not retried.
Pure Python: no torch.
"""

from __future__ import annotations

import math
from functools import cached_property
from operator import itemgetter
from collections import defaultdict
from typing import Literal, NamedTuple

from pipefisher.core.ir import Op, OpKind
from pipefisher.planning.packing.greedy import CURVATURE_KINDS
from pipefisher.planning.packing.windows import TOLERANCE, Placed, Placement, Slot, Windows
from pipefisher.planning.plan import Plan
from pipefisher.planning.simulate import COLLECTIVES, Timeline
from pipefisher.planning.tasks import CurvatureTasks, collective_groups

Leftovers = Literal["tail", "spread"]


class Built(NamedTuple):
    """A plan, the tasks it runs outside the windows, and its steps that hold any of those or a
    collective (`irregular`): every other step runs its K-FAC work inside the windows alone, so
    it takes exactly as long as a step with preconditioning only."""

    plan: Plan
    leftovers: list[Op]
    irregular: frozenset[int]


_first, _second, _end = itemgetter(0), itemgetter(1), itemgetter(2)
#: builds a named tuple from a tuple without its Python-level constructor (a hot path)
_new = tuple.__new__
_PHASE = {OpKind.CURVATURE: 0, OpKind.REFRESH: 1}
#: sequences in a window (phase 1): the greedy's count from 0, eager curvature from `_EAGER`, spread
#: leftovers from `_SPREAD`, so each sorts after all it can wait for there: the greedy's tasks wait
#: for no eager or leftover task (what waits for an unplaced task stays unplaced), curvature waits
#: for curvature and forward/backward only (never a leftover), and each group is in dependency order
_EAGER, _SPREAD = 10**9, 2 * 10**9


class PlanBuilder:
    """Plans of one task set on one first-order timeline (see the module docstring)."""

    def __init__(self, tasks: CurvatureTasks, first_order: Timeline, windows: Windows):
        self.tasks = tasks
        self.windows = windows
        self.period = windows.preconditioned.step_time  # a step with its preconditioning
        self.schedule = tasks.schedule
        self.fo = {iv.op: iv for intervals in first_order.ranks for iv in intervals}
        self.groups = collective_groups(self.schedule)
        self.rank_of = {op: self.schedule.placement[(op.pipe, op.stage)] for ops in tasks.cycle for op in ops}
        self.collectives = [op for op in self.rank_of if op.kind in COLLECTIVES]
        self.cycle_index = {op: index for index, op in enumerate(self.rank_of)}
        self.curvature_ops = [op for op in self.rank_of if op.kind in CURVATURE_KINDS]
        #: the cycle's tasks (not collectives) in `_topological_key` order, once: the cycle order
        #: (`cycle_index`) within each phase (a plan's leftovers are these less what it placed)
        phases: tuple[list[Op], ...] = ([], [], [])
        for op in self.rank_of:
            if op.kind not in COLLECTIVES:
                phases[_PHASE.get(op.kind, 2)].append(op)
        self.topological = [op for ops in phases for op in ops]
        #: the last `_add_eager_curvature`: its placement, k and the ops it added, in order
        self._eager: tuple[Placed, int, list[tuple[Op, Placement]]] | None = None

    def plan(self, placed: Placed, refresh_steps: int, leftovers: Leftovers, eager_curvature: bool = False) -> Built:
        """The plan with `refresh_steps` steps and its leftovers (tasks outside the windows)."""
        kept = {op: p for op, p in placed.tasks.items() if -1 < p.slot.step < refresh_steps}  # (collectives: step -1)
        in_windows = {p.slot.step for p in kept.values() if p.slot.phase == 1}
        weights = {step: moved for step, moved in enumerate(placed.weights[:refresh_steps]) if step in in_windows}
        left = [op for op in self.topological if op not in kept]
        if eager_curvature:
            self._add_eager_curvature(placed, refresh_steps, kept)
        rest = [op for op in left if op not in kept]
        if leftovers == "tail":
            self._append(kept, rest, refresh_steps)
        else:
            self._spread(kept, rest, refresh_steps, weights)
        collectives = self._place_collectives(kept, weights.get(0, {}))
        irregular = frozenset(kept[op].slot.step for op in left + collectives) | frozenset(weights)
        return Built(self.assemble(kept, refresh_steps, weights), left, irregular)

    def capture_order(self, placed: Placed, refresh_steps: int) -> Plan:
        """`plan(placed, refresh_steps, leftovers, eager_curvature=True)` less the tasks that are
        neither placed nor curvature, less the collectives, and less the schedule's ops after the
        first step: every other op in the same order, for less work. Its capture peaks
        (`pipefisher.planning.memory.captures`) are the plan's: captures are taken at the first
        step's forward/backward ops and freed at curvature ops, and a later step's ops only free
        them (the peak of a rank is reached in the first step, after the same op)."""
        kept = {op: p for op, p in placed.tasks.items() if -1 < p.slot.step < refresh_steps}
        self._add_eager_curvature(placed, refresh_steps, kept)
        return self.assemble(kept, refresh_steps, bare_after_first=True)

    def _add_eager_curvature(self, placed: Placed, refresh_steps: int, kept: dict[Op, Placement]) -> None:
        """Add to `kept` (`placed`'s tasks in steps < `refresh_steps`) every curvature op it lacks,
        right after its latest dependency (`_place_eagerly`), in topological order. The last
        result is kept: the capture cap asks it of one placement for its capture order and then
        for its plans (the same ops at the same places, added in the same order)."""
        memo = self._eager
        if memo is None or memo[0] is not placed or memo[1] != refresh_steps:
            curvature = [op for op in self.curvature_ops if op not in kept]  # (in topological order)
            own = dict(kept)
            self._place_eagerly(own, curvature)
            memo = self._eager = (placed, refresh_steps, [(op, own[op]) for op in curvature])
        kept.update(memo[2])

    def assemble(
        self,
        kept: dict[Op, Placement],
        refresh_steps: int,
        weights: dict[int, dict[Op, Placement]] | None = None,
        bare_after_first: bool = False,
    ) -> Plan:
        """The plan of the schedule's ops, the preconditions in their windows and `kept`; in the
        steps `weights` names, its W ops where it puts them (elsewhere where the schedule does);
        `bare_after_first`: the steps after the first hold `kept`'s ops alone."""
        weights = weights or {}
        extra: list[list[list[tuple[tuple, Op]]]] = [[[] for _ in self.schedule.ranks] for _ in range(refresh_steps)]
        placement_of, rank_of, cycle_rank = self.schedule.placement.get, self.schedule.rank_of, self.rank_of.get
        for placements in [kept] + [weights[step] for step in sorted(weights)]:
            for op, placement in placements.items():
                rank = cycle_rank(op)  # (a cycle task's placement; W ops are looked up)
                if rank is None:
                    rank = placement_of((op.pipe, op.stage))
                slot = placement[0]
                extra[slot[0]][rank_of(op) if rank is None else rank].append((slot[1:], op))
        steps = []
        bare: list[list[tuple[tuple, Op]]] = [[] for _ in self.schedule.ranks]
        for index, step in enumerate(extra):
            base = bare if bare_after_first and index else self.base_without_weights if index in weights else self.base
            ranks = []
            for rank, items in enumerate(step):
                items = base[rank] + items
                items.sort(key=_first)  # sorted runs when kept is in window order: a merge
                ranks.append(tuple(map(_second, items)))
            steps.append(tuple(ranks))
        return Plan(
            schedule=self.schedule, steps=tuple(steps), method=self.tasks.profile.method, rules=self.tasks.rules
        )

    @cached_property
    def base(self) -> list[list[tuple[tuple, Op]]]:
        """Per rank, the ops of every step (forward/backward and weight gradients where the
        schedule puts them, preconditions and folds) sorted by slot less its step. A precondition
        or fold with no bubble goes where the step with its preconditioning runs it, after all of
        the step's work: before the windows that open after it there (the greedy's windows)."""
        return self._base(moving_weights=False)

    @cached_property
    def base_without_weights(self) -> list[list[tuple[tuple, Op]]]:
        """`base` less the weight gradients (for steps where they move), its preconditions with no
        bubble after all of the step's work and windows: a moved W op may run past their start in
        the step with its preconditioning, and they wait for it."""
        return [[item for item in items if item[1].kind is not OpKind.WEIGHT] for items in self._base(True)]

    def _base(self, moving_weights: bool) -> list[list[tuple[tuple, Op]]]:
        starts = {iv.op: iv.start for intervals in self.windows.preconditioned.ranks for iv in intervals}
        base = []
        for rank, compute in enumerate(self.schedule.ranks):
            items = [(Slot(0, self.fo[op].start, 0, 0)[1:], op) for op in compute]
            for op in self.tasks.per_step[rank]:
                window = self.windows.precondition_window[op]
                if window is None:
                    window = math.inf if moving_weights and op.kind is not OpKind.FOLD else starts[op]
                items.append((Slot(0, window, 1, -1)[1:], op))
            base.append(sorted(items, key=_first))
        return base

    def _free(self, rank: int, step: int, weights: dict[int, dict[Op, Placement]]) -> tuple[tuple[float, float], ...]:
        """The windows of `rank` in `step`: with the W ops' time where they move in that step."""
        moving = self.windows.weights if step in weights else None
        return (moving if moving is not None else self.windows).free[rank]

    # -- leftovers ------------------------------------------------------------------------------
    def _append(self, kept: dict[Op, Placement], leftovers: list[Op], refresh_steps: int) -> None:
        last = refresh_steps - 1
        end_of = {op: p.end for op, p in kept.items()}
        tail: dict[int, float] = defaultdict(float)
        for sequence, op in enumerate(leftovers):
            rank = self.rank_of[op]
            start = max(self._release(op, end_of), (last + 1) * self.period + tail[rank])
            tail[rank] = start + self.tasks.durations(op) - (last + 1) * self.period
            kept[op] = Placement(Slot(last, math.inf, 2, sequence), start, start + self.tasks.durations(op))
            end_of[op] = kept[op].end

    def _spread(
        self,
        kept: dict[Op, Placement],
        leftovers: list[Op],
        refresh_steps: int,
        weights: dict[int, dict[Op, Placement]],
    ) -> None:
        """Each leftover where it raises its step's largest per-rank extension least; an extension
        is the part of a task its window's free time lacks (W ops that moved in a step use their
        windows there, `weights`). In order: a window starts no earlier than the leftover's release
        (less `TOLERANCE`), and within one it sorts after `kept`'s (`_SPREAD`) and earlier leftovers;
        it runs after a step's work only if released before that step ends (a later step's ops end
        no earlier), so never in a step before what it waits for."""
        last = refresh_steps - 1
        end_of = {op: p.end for op, p in kept.items()}
        cursor: dict[tuple[int, int, float], float] = {}  # (rank, step, window start) -> cursor
        for rank in range(self.schedule.num_ranks):
            for step in range(refresh_steps):
                for start, _ in self._free(rank, step, weights):
                    cursor[(rank, step, start)] = step * self.period + start
        for op, p in [
            item for placements in [kept, *weights.values()] for item in placements.items()
        ]:  # consume what the greedy used
            if p.slot.phase == 1:
                key = (self.schedule.rank_of(op), p.slot.step, p.slot.window)
                cursor[key] = max(cursor[key], p.end)
        extension: dict[tuple[int, int], float] = defaultdict(float)
        step_max: dict[int, float] = defaultdict(float)
        tail: dict[tuple[int, int], float] = defaultdict(float)
        for sequence, op in enumerate(leftovers):
            rank, work, ready = self.rank_of[op], self.tasks.durations(op), self._release(op, end_of)
            candidates: list[tuple[float, int, tuple[float, float] | None]] = [
                (max(0.0, work - (step * self.period + end - cursor[(rank, step, start)])), step, (start, end))
                for step in range(refresh_steps)
                for start, end in self._free(rank, step, weights)
                if step * self.period + start + TOLERANCE >= ready
            ]
            candidates += [
                (work, step, None) for step in range(refresh_steps) if ready < (step + 1) * self.period or step == last
            ]
            added, step, window = min(
                candidates, key=lambda c: (max(0.0, extension[(rank, c[1])] + c[0] - step_max[c[1]]), c[0], c[1])
            )
            extension[(rank, step)] += added
            step_max[step] = max(step_max[step], extension[(rank, step)])
            if window is not None:
                key = (rank, step, window[0])
                start = max(cursor[key], ready)
                cursor[key] = max(start + work, step * self.period + window[1])
                slot = Slot(step, window[0], 1, _SPREAD + sequence)
            else:
                start = max(ready, (step + 1) * self.period + tail[(rank, step)])
                tail[(rank, step)] += work
                slot = Slot(step, math.inf, 2, sequence)
            kept[op] = Placement(slot, start, start + work)
            end_of[op] = kept[op].end

    def _place_eagerly(self, kept: dict[Op, Placement], curvature: list[Op]) -> None:
        """Curvature right after its latest dependency (its forward/backward of step 0, or the
        previous micro-batch's curvature of the factor), extending that step: after the
        forward/backward itself, or at the end of the window its predecessor ran in. In order: its
        slot follows its latest dependency's (sequence 1.. after a forward/backward's 0, or
        `_EAGER` + its index past the greedy's and the earlier, topologically, eager ones); in a
        window it starts after all the window holds on its rank so far, so its time follows too."""
        first_order, inputs, placed = self._first_order_placements, self._curvature_inputs, kept.get
        rank_of = self.rank_of
        filled: dict[tuple[int, int, float], float] = {}  # (rank, step, window) -> end of what it holds
        for held, p in kept.items():
            if p.slot.phase == 1:
                key = (rank_of[held], p.slot.step, p.slot.window)
                filled[key] = max(filled.get(key, p.end), p.end)
        for sequence, op in enumerate(curvature, start=1):
            dependencies, work = inputs[op]
            slots = [placed(dep) or first_order[dep] for dep in dependencies]
            step, window, phase, _, launch = max(slots, key=_first)[0]
            start = max(map(_end, slots))
            if phase == 1:
                key = (rank_of[op], step, window)
                start = max(start, filled.get(key, start))
                filled[key] = start + work
            slot = _new(Slot, (step, window, phase, sequence if phase == 0 else _EAGER + sequence, launch))
            kept[op] = _new(Placement, (slot, start, start + work))

    @cached_property
    def _curvature_inputs(self) -> dict[Op, tuple[tuple[Op, ...], float]]:
        """Each curvature op's dependencies (in the cycle's first step) and time."""
        dependencies, durations = self.tasks.graph.dependencies, self.tasks.durations
        return {op: (dependencies(op), durations(op)) for op in self.curvature_ops}

    @cached_property
    def _first_order_placements(self) -> dict[Op, Placement]:
        """Each forward/backward's placement in step 0."""
        return {op: Placement(Slot(0, iv.start, 0, 0), iv.start, iv.end) for op, iv in self.fo.items()}

    def _topological_key(self, op: Op) -> tuple[int, int]:
        """Curvature, then inverses, then the rest; within each, `tasks.cycle` order (a chain's
        micro-batches in their order)."""
        return (_PHASE.get(op.kind, 2), self.cycle_index[op])

    def _release(self, op: Op, end_of: dict[Op, float]) -> float:
        """Earliest global start of `op` given placed tasks (collectives resolved through)."""
        ready = 0.0
        for dep in self.tasks.graph.dependencies(op):
            if dep.kind in COLLECTIVES:
                ready = max(ready, self._release(dep, end_of) + self.tasks.durations.work(dep))
            elif dep in end_of:
                ready = max(ready, end_of[dep])
            elif dep.kind.is_compute:
                ready = max(ready, self.fo[dep].end)
        return ready

    # -- collectives ----------------------------------------------------------------------------
    def _place_collectives(self, kept: dict[Op, Placement], first_weights: dict[Op, Placement]) -> list[Op]:
        """Launch every collective right after its own dependencies, in one order per group:
        syncs first, then exchanges (which wait for every replica's syncs of their layer);
        `first_weights`: the W ops the greedy moved in the first step, which a gradient-based
        method's syncs wait for. Returns the collectives."""
        last: dict[frozenset[int], dict[int, Slot]] = defaultdict(dict)
        for kinds in ({OpKind.SYNC}, {OpKind.EXCHANGE}):
            self._place_collectives_of([op for op in self.collectives if op.kind in kinds], kept, first_weights, last)
        return self.collectives

    def _place_collectives_of(
        self,
        collectives: list[Op],
        kept: dict[Op, Placement],
        first_weights: dict[Op, Placement],
        last: dict[frozenset[int], dict[int, Slot]],
    ) -> None:
        """Place `collectives` after their dependencies' final places; `last[group][rank]`: the slot
        of the group's last collective on that rank so far (updated). In order: a slot is its
        dependencies' latest with a higher `launch`, and rises on each rank in the group's order:
        by when they are ready (what waits for one starts no earlier), ties (zero-time tasks) by
        the latest of its members' own slots, which follows every rank's order where they agree."""
        own: dict[Op, tuple[float, Slot]] = {}
        dependencies, first_order = self.tasks.graph.dependencies, self._first_order_placements
        for op in collectives:
            deps = []
            for d in dependencies(op):
                placement = kept.get(d)
                if placement is None:
                    if not d.kind.is_compute:
                        continue
                    placement = first_weights.get(d) or first_order[d]
                deps.append(placement)
            own[op] = (max(p.end for p in deps), max(p.slot for p in deps)) if deps else (0.0, Slot(0, -math.inf, 0, 0))
        members: dict[tuple, list[Op]] = defaultdict(list)
        for op in collectives:
            members[(op.token, op.stage, op.layer)].append(op)
        per_group: dict[frozenset[int], list[tuple]] = defaultdict(list)
        for (token, stage, layer), ops in members.items():
            ready, latest = max(own[op][0] for op in ops), max(own[op][1] for op in ops)
            exchange = token == OpKind.EXCHANGE.value
            per_group[self.groups[stage]].append((ready, latest, exchange, stage, layer, token, ops))
        for group, entries in per_group.items():
            group_last = last[group]
            for *_, ops in sorted(entries, key=lambda entry: entry[:6]):
                for op in ops:
                    ready, slot = own[op]
                    base = max(slot, group_last.get(self.rank_of[op], slot))
                    group_last[self.rank_of[op]] = slot = base._replace(launch=base.launch + 1)
                    kept[op] = Placement(slot, ready, ready)
