"""The task graph of a curvature method's refresh cycle: which ops exist, on which rank, and what
each waits for (the method's `TaskRules`, `pipefisher.planning.vocabulary`, which the caller gives).

Per layer of every (pipe, stage): curvature of each part per micro-batch of that pipe (part 0
after the micro-batch's forward, part 1 after its backward, and both after the part's curvature of
the previous micro-batch); a sync per synced part and replica when the stage has replicas (other
pipes, data-parallel copies) (after that replica's curvature of the part, or, for gradient-based
methods such as Shampoo, after its backwards of the cycle's first step); refresh work per part (after
all replicas' syncs of its input, or after its curvature or backwards when unreplicated); an
exchange per replica when the refresh work is split between replicas (after its replica's refresh
work and every replica's syncs of the layer); and, for methods that precondition before the
gradient reduction, a precondition per (pipe, stage) in every step (after its backwards); for
methods with deferred statistics, a fold per (pipe, stage) in every step (of the previous step's
gradient: after nothing of its own step; nothing waits for it either: whatever reads the
statistics first folds what is held, `pipefisher.methods.soap.engine`).

Where the schedule splits the backward (W ops), the stage's gradient is whole only after its
weight gradients: preconditions, and a gradient-based method's inputs, wait for the W ops then;
curvature of part 1 still waits for the B op (the input gradient), where the output gradients
it reads are captured.
Pure Python: no torch.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, replace
from functools import cached_property

from pipefisher.core.ir import Op, OpKind, Schedule, backward, dependencies, weight
from pipefisher.core.profile import Profile
from pipefisher.planning.simulate import OpDurations, check_profile
from pipefisher.planning.vocabulary import TaskRules

#: the compute op whose data the curvature of each part reads: inputs, output gradients
_PRODUCER = (OpKind.FORWARD, OpKind.BACKWARD)

#: Kinds that make up a refresh cycle's work (precondition recurs every step instead).
CYCLE_KINDS = frozenset({OpKind.CURVATURE, OpKind.SYNC, OpKind.REFRESH, OpKind.EXCHANGE})


class TaskGraph:
    """Dependencies among the curvature ops of one cycle, derived from the ops and `rules`.

    `ops` are the cycle's ops (curvature, sync, refresh, exchange); precondition ops may be
    included or not. Which micro-batches a pipe processes comes from `schedule`. `rules` None:
    the graph of forward and backward ops alone (a plan without a method's ops).
    """

    def __init__(self, schedule: Schedule, ops: Iterable[Op], rules: TaskRules | None):
        self.schedule, self.rules = schedule, rules
        self.micro_batches: dict[int, list[int]] = defaultdict(list)
        #: the ops that complete a micro-batch's share of the stage's gradient
        self._gradient_op = weight if schedule.splits_backward else backward
        #: (kind, stage, micro-batch, pipe) -> the schedule's forward/backward op
        self._compute: dict[tuple, Op] = {}
        for _, _, op in schedule.ops():
            self._compute[(op.kind, op.stage, op.micro_batch, op.pipe)] = op
            if op.kind is OpKind.FORWARD and op.stage == 0 and op.micro_batch is not None:  # a forward has one
                self.micro_batches[op.pipe].append(op.micro_batch)
        self._curvature: dict[tuple, list[Op]] = defaultdict(list)
        self._syncs: dict[tuple, list[Op]] = defaultdict(list)
        self._refreshes: dict[tuple, list[Op]] = defaultdict(list)
        for op in ops:
            if op.kind is OpKind.CURVATURE:
                self._curvature[(op.part, op.pipe, op.stage, op.layer)].append(op)
            elif op.kind is OpKind.SYNC:
                self._syncs[(op.part, op.stage, op.layer)].append(op)
            elif op.kind is OpKind.REFRESH:
                self._refreshes[(op.pipe, op.stage, op.layer)].append(op)
        position: dict[int, dict[int | None, int]] = {
            pipe: {mb: i for i, mb in enumerate(order)} for pipe, order in self.micro_batches.items()
        }
        self._previous: dict[Op, Op] = {}
        for (_, pipe, _, _), curvature in self._curvature.items():
            in_order = sorted(set(curvature), key=lambda op: position[pipe][op.micro_batch])
            self._previous.update(zip(in_order[1:], in_order))
        self._memo: dict[tuple[Op, bool], tuple[Op, ...]] = {}

    def dependencies(self, op: Op, first_step: bool = True) -> tuple[Op, ...]:
        """Ops `op` waits for. Curvature in later steps of a cycle reads data saved in the first
        step, so it waits for nothing then."""
        found = self._memo.get((op, first_step))
        if found is None:
            found = self._memo[(op, first_step)] = self._derive(op, first_step)
        return found

    def first_step_input(self, op: Op) -> Op | None:
        """The forward (curvature of part 0) or backward (part 1) whose data a curvature op reads;
        None for other ops."""
        if op.kind is not OpKind.CURVATURE or op.part is None:
            return None
        return self._compute[(_PRODUCER[op.part], op.stage, op.micro_batch, op.pipe)]

    def first_step_inputs(self, op: Op) -> tuple[Op, ...]:
        """The forwards/backwards of the cycle's first step whose data `op` reads (its
        dependencies in that step that are compute ops)."""
        return tuple(dep for dep in self.dependencies(op, first_step=True) if dep.kind.is_compute)

    def gradient_ops(self, op: Op) -> tuple[Op, ...]:
        """The ops after which the gradient of `op`'s (pipe, stage) in a step is whole: its
        backwards, or its weight gradients where the schedule splits the backward."""
        return tuple(self._gradient_op(op.stage, mb, op.pipe) for mb in self.micro_batches[op.pipe])

    def _gradient(self, op: Op, first_step: bool) -> tuple[Op, ...]:
        """`gradient_ops` in the cycle's first step (later steps read the gradient captured then:
        nothing to wait for)."""
        return self.gradient_ops(op) if first_step else ()

    def _derive(self, op: Op, first_step: bool) -> tuple[Op, ...]:
        kind = op.kind
        if kind.is_compute:
            return dependencies(op, self.schedule.num_stages)
        if kind in (OpKind.PRECONDITION, OpKind.HELP):  # a help is a layer's share of the precondition
            return self.gradient_ops(op)
        if kind is OpKind.FOLD:
            return ()  # it folds the previous step's gradient: nothing of its own step
        if self.rules is None:
            raise ValueError(f"{op}: a task graph without a method's rules has no rule for it")
        if kind is OpKind.CURVATURE:
            first = self.first_step_input(op) if first_step else None
            return ((first,) if first is not None else ()) + self._previous_curvature(op)
        part = op.part if op.part is not None else 0
        if kind is OpKind.SYNC:
            return self._input(op, part, first_step)
        if kind is OpKind.REFRESH:
            source = self.rules.sync_for(part)
            syncs = self._syncs.get((source, op.stage, op.layer)) if source is not None else None
            if syncs:
                return tuple(syncs)
            return self._input(op, part, first_step)
        if kind is OpKind.EXCHANGE:
            # its replica folds the synced parts it did not refresh into its running average
            folded = (sync for part in self.rules.parts for sync in self._syncs.get((part, op.stage, op.layer), ()))
            return tuple(self._refreshes[(op.pipe, op.stage, op.layer)]) + tuple(folded)
        raise ValueError(f"no dependency rule for {op}")

    def _input(self, op: Op, part: int, first_step: bool) -> tuple[Op, ...]:
        """What the part's input waits for on `op`'s pipe: its curvature, or the gradient."""
        if self.rules is not None and self.rules.curvature:
            return tuple(self._curvature[(part, op.pipe, op.stage, op.layer)])
        return self._gradient(op, first_step)

    def _previous_curvature(self, op: Op) -> tuple[Op, ...]:
        """The same part's curvature of the pipe's previous micro-batch: a part sums its
        micro-batches in order whatever the plan, so every plan computes bit-identical factors."""
        previous = self._previous.get(op)
        return (previous,) if previous is not None else ()


@dataclass(frozen=True)
class CurvatureTasks:
    """The work of curvature method `rules` for `schedule` with the layers and times of `profile`.

    `cycle[rank]`: ops run once per refresh cycle, in a topological order (curvature, syncs,
    refresh work, exchanges). `per_step[rank]`: precondition and fold ops run in every step (none
    for methods that precondition in the optimizer step and fold there).
    """

    schedule: Schedule
    profile: Profile
    cycle: tuple[tuple[Op, ...], ...]
    per_step: tuple[tuple[Op, ...], ...]
    split: bool
    rules: TaskRules

    @cached_property
    def graph(self) -> TaskGraph:
        return TaskGraph(self.schedule, (op for ops in self.cycle for op in ops), self.rules)

    @cached_property
    def durations(self) -> OpDurations:
        return OpDurations(self.profile, split_backward=self.schedule.splits_backward)

    @cached_property
    def cycle_work(self) -> tuple[tuple[float, ...], ...]:
        """`cycle_work[rank][i]`: how long `cycle[rank][i]` keeps its rank busy (0 for collectives)."""
        same: dict[tuple | Op, float] = {}  # curvature of one layer takes as long for every micro-batch
        keys = [
            [(op.kind, op.part, op.stage, op.layer) if op.micro_batch is not None else op for op in ops]
            for ops in self.cycle
        ]
        for ops, rank_keys in zip(self.cycle, keys):
            for op, key in zip(ops, rank_keys):
                if key not in same:
                    same[key] = self.durations(op)
        return tuple(tuple(same[key] for key in rank_keys) for rank_keys in keys)


def stage_replicas(schedule: Schedule) -> dict[int, list[int]]:
    """stage -> pipes that hold a replica of it (Chimera: both pipes)."""
    replicas: dict[int, list[int]] = defaultdict(list)
    for pipe, stage in sorted(schedule.placement):
        replicas[stage].append(pipe)
    return replicas


def collective_groups(schedule: Schedule) -> dict[int, frozenset[int]]:
    """stage -> the ranks holding its replicas (the process group of its K-FAC collectives)."""
    return {
        stage: frozenset(schedule.placement[(pipe, stage)] for pipe in pipes)
        for stage, pipes in stage_replicas(schedule).items()
    }


def _refresh_owners(
    schedule: Schedule, profile: Profile, split: bool, parts: range
) -> dict[tuple[int, int, str], list[int]]:
    """(part, stage, layer) -> pipes whose rank does the part's refresh work, for the method's `parts`.

    Unsplit, every replica refreshes its own copy. Split, each part's refresh work goes to one
    replica: longest first to the least-loaded rank among those holding the stage (ties to the
    lower rank).
    """
    replicas = stage_replicas(schedule)
    owners: dict[tuple[int, int, str], list[int]] = {}
    jobs = [
        (layer.time("refresh", part), part, stage, layer.name)
        for stage, stage_profile in enumerate(profile.stages)
        for layer in stage_profile.layers
        for part in parts
    ]
    if not split:
        return {(part, stage, name): list(replicas[stage]) for _, part, stage, name in jobs}
    load = [0.0] * schedule.num_ranks
    for cost, part, stage, name in sorted(jobs, key=lambda job: (-job[0], job[2], job[3], job[1])):
        pipe = min(
            replicas[stage], key=lambda p: (load[schedule.placement[(p, stage)]], schedule.placement[(p, stage)])
        )
        load[schedule.placement[(pipe, stage)]] += cost
        owners[(part, stage, name)] = [pipe]
    return owners


def build_tasks(
    schedule: Schedule,
    profile: Profile,
    rules: TaskRules,
    split: bool = True,
    data_parallel: int = 1,
    precondition: bool = True,
) -> CurvatureTasks:
    """Enumerate the ops of one refresh cycle of the curvature method of `rules` (the method the
    profile's layer times are of) for `schedule` (see the module docstring).

    A stage's replicas are its pipes times the `data_parallel` copies of the pipeline: inputs are
    synced over all of them; refresh work is split among the pipes only (every data-parallel copy
    of the pipeline computes the same) and exchanged among them. `precondition` False drops the
    method's per-step precondition ops (K-FAC with gradient workers, `pipefisher.planning.replicas.kaisa`: they
    precondition the reduced gradient at the end of the step instead).
    """
    check_profile(schedule, profile)
    if not precondition:
        rules = replace(rules, precondition=False, helpers=False, step_end_precondition=False)
    replicas = stage_replicas(schedule)
    owners = _refresh_owners(schedule, profile, split, rules.parts)
    graph_mbs = TaskGraph(schedule, (), rules).micro_batches
    cycle: list[list[Op]] = [[] for _ in range(schedule.num_ranks)]
    per_step: list[list[Op]] = [[] for _ in range(schedule.num_ranks)]
    phases: list[list[tuple[int, Op]]] = [[], [], [], []]
    for (pipe, stage), rank in sorted(schedule.placement.items()):
        layers = profile.stages[stage].layers
        if not layers:
            continue
        synced = len(replicas[stage]) * data_parallel > 1
        exchanged = len(replicas[stage]) > 1 and split and bool(rules.parts)
        for layer in layers:
            name = layer.name
            for part in rules.parts:
                if rules.curvature:
                    phases[0] += [(rank, Op(OpKind.CURVATURE, stage, mb, pipe, name, part)) for mb in graph_mbs[pipe]]
                if synced and part in rules.syncs:
                    phases[1].append((rank, Op(OpKind.SYNC, stage, None, pipe, name, part)))
                if pipe in owners[(part, stage, name)]:
                    phases[2].append((rank, Op(OpKind.REFRESH, stage, None, pipe, name, part)))
            if exchanged:
                phases[3].append((rank, Op(OpKind.EXCHANGE, stage, None, pipe, name)))
        if rules.precondition:
            per_step[rank].append(Op(OpKind.PRECONDITION, stage, None, pipe))
        if rules.deferred_statistics:
            per_step[rank].append(Op(OpKind.FOLD, stage, None, pipe))
    for phase in phases:
        for rank, op in phase:
            cycle[rank].append(op)
    return CurvatureTasks(
        schedule=schedule,
        profile=profile,
        cycle=tuple(tuple(ops) for ops in cycle),
        per_step=tuple(tuple(ops) for ops in per_step),
        split=split,
        rules=rules,
    )
