"""Schedule checks: placement, op counts, and a dependency-respecting dry run (no deadlock).

The dry run (and the simulator) work on an `OpGraph`: per-rank op lists with every op numbered
and its dependencies resolved to numbers once, so that running the lists costs list lookups
only. A plain schedule's graph is built once per schedule (`schedule_graph`).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Generic, TypeVar
from operator import attrgetter
from weakref import finalize

from pipefisher.core.ir import Op, OpKind, Schedule, ScheduleError, dependencies, format_grid, stage_dependencies

DependencyFn = Callable[[Op], tuple[Op, ...]]

#: An op's fields; two ops are equal exactly when these are.
_FIELDS = attrgetter("kind", "stage", "micro_batch", "pipe", "layer", "part")


def _fail(name: str, ranks: Sequence[Sequence[Op]], message: str, marks: list[tuple[int, int]]) -> ScheduleError:
    return ScheduleError(f"{name}: {message}\n{format_grid(ranks, marks)}")


class StageDependencies:
    """The dependency function of a plain schedule with `num_stages` stages (`ir.dependencies`).

    `op_graph` recognises it and resolves the dependencies on op fields, without building ops.
    """

    def __init__(self, num_stages: int) -> None:
        self.num_stages = num_stages

    def __call__(self, op: Op) -> tuple[Op, ...]:
        return dependencies(op, self.num_stages)


def schedule_dependencies(schedule: Schedule) -> DependencyFn:
    """The dependency function of a plain schedule (forward/backward order across stages)."""
    return StageDependencies(schedule.num_stages)


@dataclass(eq=False)
class OpGraph:
    """Per-rank op lists with every op numbered and its dependencies resolved to numbers.

    Op number i, `ops[i]`, is the op at place i of the lists (taken rank by rank, in order);
    after the places come the dependencies that no list holds (they never run). A repeated op
    goes by the number of its first place. `ranks[r]`: the numbers of rank r's list. `deps[i]`
    (for i below the number of places): the numbers of the ops op i waits for, in the order the
    dependency function names them. Read-only: graphs are shared (see `schedule_graph`).
    """

    ops: list[Op]
    ranks: list[list[int]]
    deps: list[tuple[int, ...]]
    #: the dependencies as the dependency function returned them, where it was called
    dep_ops: list[tuple[Op, ...]] | None = None
    _order: tuple[list[int], list[int]] | None = field(default=None, init=False, repr=False)

    def order(self, name: str = "schedule") -> tuple[list[int], list[int]]:
        """Every op of the lists in an order where each follows its dependencies, as parallel
        lists of ranks and op numbers (computed once). Each rank runs its list in order; an op
        waits until the ops it depends on have run (on any rank). Raises ScheduleError (with the
        grid, stuck ops marked, and `name`) if the lists deadlock.
        """
        if self._order is None:
            self._order = _run_order(self, name)
        return self._order

    def dependency_ops(self, number: int) -> tuple[Op, ...]:
        """The ops that op `number` waits for."""
        if self.dep_ops is not None:
            return self.dep_ops[number]
        return tuple(self.ops[dep] for dep in self.deps[number])


Key = TypeVar("Key", bound=Hashable)


class Numbering(dict[Key, int], Generic[Key]):
    """Key -> number. Looking up a key that has none gives it the next free number (counting on
    from `next_free`) and lists the key in `added`."""

    def __init__(self, items: Iterable[tuple[Key, int]] = (), next_free: int = 0) -> None:
        super().__init__(items)
        self.next_free = next_free
        self.added: list[Key] = []

    def __missing__(self, key: Key) -> int:
        number = self[key] = self.next_free
        self.next_free += 1
        self.added.append(key)
        return number


def _number(keys_per_rank: Sequence[Sequence[Key]]) -> tuple[Numbering[Key], list[list[int]]]:
    """Number each key by its first place in the lists, rank by rank (a repeated key keeps that
    number); return the numbering and each rank's numbers."""
    flat = list(chain.from_iterable(keys_per_rank))
    numbers = Numbering(zip(reversed(flat), range(len(flat) - 1, -1, -1)), next_free=len(flat))
    return numbers, [list(map(numbers.__getitem__, keys)) for keys in keys_per_rank]


def op_graph(ranks: Sequence[Sequence[Op]], deps: DependencyFn) -> OpGraph:
    """The `OpGraph` of `ranks` with dependencies `deps`; `deps` is called once per place."""
    if isinstance(deps, StageDependencies):
        return _stage_graph(ranks, deps.num_stages)
    numbers, numbered = _number(ranks)
    ops = list(chain.from_iterable(ranks))
    dep_ops = list(map(deps, ops))
    dep_numbers = [tuple(map(numbers.__getitem__, dependencies)) for dependencies in dep_ops]
    return OpGraph(ops=ops + numbers.added, ranks=numbered, deps=dep_numbers, dep_ops=dep_ops)


def _stage_graph(ranks: Sequence[Sequence[Op]], num_stages: int) -> OpGraph:
    """`op_graph` for `StageDependencies`: ops are keyed by their fields, and the dependency rule
    (`ir.stage_dependencies`) is evaluated once per (kind, stage)."""
    fields: list[list[tuple]] = [list(map(_FIELDS, ops)) for ops in ranks]
    numbers, numbered = _number(fields)
    rules: dict[tuple[OpKind, int], tuple[tuple[OpKind, int], ...]] = {}
    dep_numbers = []
    for kind, stage, micro_batch, pipe, _, _ in chain.from_iterable(fields):
        rule = rules.get((kind, stage))
        if rule is None:
            rule = rules[(kind, stage)] = stage_dependencies(kind, stage, num_stages)
        row = []
        for dep_kind, dep_stage in rule:
            row.append(numbers[(dep_kind, dep_stage, micro_batch, pipe, None, None)])
        dep_numbers.append(tuple(row))
    ops = list(chain.from_iterable(ranks)) + [Op(*key) for key in numbers.added]
    return OpGraph(ops=ops, ranks=numbered, deps=dep_numbers)


#: id(schedule) -> its OpGraph, while the schedule lives (see `schedule_graph`)
_SCHEDULE_GRAPHS: dict[int, OpGraph] = {}


def schedule_graph(schedule: Schedule) -> OpGraph:
    """The `OpGraph` of a plain schedule: `op_graph(schedule.ranks, schedule_dependencies(schedule))`.

    Schedules are immutable, so the graph (and its order) is built once per schedule object and
    dropped with it: validating and then simulating a schedule numbers and orders its ops once.
    """
    key = id(schedule)
    graph = _SCHEDULE_GRAPHS.get(key)
    if graph is None:
        graph = _SCHEDULE_GRAPHS[key] = op_graph(schedule.ranks, schedule_dependencies(schedule))
        finalize(schedule, _SCHEDULE_GRAPHS.pop, key, None)
    return graph


def _run_order(graph: OpGraph, name: str) -> tuple[list[int], list[int]]:
    """`OpGraph.order`, computed: each rank runs its list as far as the dependencies allow, and
    a rank that waits resumes once the op it waits for has run."""
    deps, ranks = graph.deps, graph.ranks
    positions = [0] * len(ranks)
    done = [False] * len(graph.ops)
    waiting: dict[int, list[int]] = {}
    ready = deque(range(len(ranks)))
    order_ranks: list[int] = []
    order: list[int] = []
    while ready:
        rank = ready.popleft()
        numbers, position = ranks[rank], positions[rank]
        while position < len(numbers):
            number = numbers[position]
            for dep in deps[number]:
                if not done[dep]:
                    waiting.setdefault(dep, []).append(rank)
                    break
            else:
                order_ranks.append(rank)
                order.append(number)
                done[number] = True
                if number in waiting:
                    ready.extend(waiting.pop(number))
                position += 1
                continue
            break
        positions[rank] = position
    if len(order) < sum(map(len, ranks)):
        raise _deadlock(graph, positions, done, name)
    return order_ranks, order


def _deadlock(graph: OpGraph, positions: list[int], done: list[bool], name: str) -> ScheduleError:
    stuck = [(rank, pos) for rank, pos in enumerate(positions) if pos < len(graph.ranks[rank])]
    reasons = []
    for rank, pos in stuck:
        number = graph.ranks[rank][pos]
        missing = [str(graph.ops[dep]) for dep in graph.deps[number] if not done[dep]]
        reasons.append(f"rank {rank} waits at {graph.ops[number]} for {', '.join(missing)}")
    ranks = [[graph.ops[number] for number in numbers] for numbers in graph.ranks]
    return _fail(name, ranks, "deadlock: " + "; ".join(reasons), stuck)


def execution_order(
    ranks: Sequence[Sequence[Op]], deps: DependencyFn, name: str = "schedule"
) -> Iterator[tuple[int, Op, tuple[Op, ...]]]:
    """Yield (rank, op, its dependencies) in an order where every op follows its dependencies.

    Each rank runs its list in order; an op waits until the ops `deps(op)` names have run (on any
    rank). Raises ScheduleError (with the grid, stuck ops marked) if the lists deadlock; it
    does so before yielding anything.
    """
    graph = op_graph(ranks, deps)
    for rank, number in zip(*graph.order(name)):
        yield rank, graph.ops[number], graph.dependency_ops(number)


def _check_placement(schedule: Schedule) -> None:
    expected = {(pipe, stage) for pipe in range(schedule.num_pipes) for stage in range(schedule.num_stages)}
    if set(schedule.placement) != expected:
        missing = sorted(expected - set(schedule.placement))
        extra = sorted(set(schedule.placement) - expected)
        raise ScheduleError(
            f"{schedule.name}: placement must map every (pipe, stage); missing {missing}, unexpected {extra}"
        )
    for (pipe, stage), rank in schedule.placement.items():
        if not 0 <= rank < schedule.num_ranks:
            raise ScheduleError(
                f"{schedule.name}: pipe {pipe} stage {stage} placed on rank {rank}, but there are {schedule.num_ranks} ranks"
            )
    pipe_stage = attrgetter("pipe", "stage")
    for rank, ops in enumerate(schedule.ranks):
        if any(schedule.placement.get(key) != rank for key in set(map(pipe_stage, ops))):
            _raise_first_misplaced(schedule, rank)


def _raise_first_misplaced(schedule: Schedule, rank: int) -> None:
    for position, op in enumerate(schedule.ranks[rank]):
        if op.pipe >= schedule.num_pipes or op.stage >= schedule.num_stages:
            raise _fail(
                schedule.name, schedule.ranks, f"op {op} names a pipe or stage outside the schedule", [(rank, position)]
            )
        home = schedule.placement[(op.pipe, op.stage)]
        if home != rank:
            raise _fail(
                schedule.name,
                schedule.ranks,
                f"op {op} is on rank {rank} but its stage lives on rank {home}",
                [(rank, position)],
            )


def _counts_are_right(schedule: Schedule) -> bool:
    """Whether `_raise_count_error` would find nothing, for a schedule whose ops are placed right.

    No op repeats and every micro-batch is in range and in one pipe; then the forward, backward
    and weight-gradient ops, all distinct, of valid stages and of their micro-batch's pipe, are
    all there exactly when there are stages × micro-batches forwards and as many backwards, and
    as many weight gradients or none.
    """
    ops = list(chain.from_iterable(schedule.ranks))
    if len(set(ops)) != len(ops):
        return False
    owners = {pair for pair in map(attrgetter("micro_batch", "pipe"), ops) if pair[0] is not None}
    micro_batches = {micro_batch for micro_batch, _ in owners}
    if len(micro_batches) != len(owners) or micro_batches != set(range(schedule.num_micro_batches)):
        return False
    kinds = Counter(map(attrgetter("kind"), ops))
    per_kind = schedule.num_stages * schedule.num_micro_batches
    return kinds[OpKind.FORWARD] == kinds[OpKind.BACKWARD] == per_kind and kinds[OpKind.WEIGHT] in (0, per_kind)


def _raise_count_error(schedule: Schedule) -> None:
    """Raise ScheduleError for the first repeated, stray or missing op, if any."""
    seen: Counter[Op] = Counter()
    pipe_of_micro_batch: dict[int, int] = {}
    for rank, position, op in schedule.ops():
        seen[op] += 1
        if seen[op] > 1:
            raise _fail(schedule.name, schedule.ranks, f"op {op} appears more than once", [(rank, position)])
        if op.micro_batch is None:
            continue
        if not 0 <= op.micro_batch < schedule.num_micro_batches:
            raise _fail(
                schedule.name,
                schedule.ranks,
                f"op {op}: micro-batch outside 0..{schedule.num_micro_batches - 1}",
                [(rank, position)],
            )
        owner = pipe_of_micro_batch.setdefault(op.micro_batch, op.pipe)
        if owner != op.pipe:
            raise _fail(
                schedule.name,
                schedule.ranks,
                f"op {op}: micro-batch {op.micro_batch} already belongs to pipe {owner}",
                [(rank, position)],
            )
    kinds = (OpKind.FORWARD, OpKind.BACKWARD) + (
        (OpKind.WEIGHT,) if any(op.kind is OpKind.WEIGHT for op in seen) else ()
    )
    for mb in range(schedule.num_micro_batches):
        pipe = pipe_of_micro_batch.get(mb)
        if pipe is None:
            raise _fail(schedule.name, schedule.ranks, f"micro-batch {mb} is never processed", [])
        for stage in range(schedule.num_stages):
            for kind in kinds:
                op = Op(kind, stage, mb, pipe)
                if op not in seen:
                    raise _fail(schedule.name, schedule.ranks, f"op {op} is missing", [])


def validate(schedule: Schedule) -> Schedule:
    """Check that `schedule` can run; return it unchanged or raise ScheduleError.

    Checks: every (pipe, stage) has a rank and its ops sit on that rank; every micro-batch
    belongs to one pipe and gets exactly one forward and one backward per stage (and one weight
    gradient, where the schedule splits the backward: all of its stages or none); the per-rank
    lists run to completion when each op waits for its dependencies (forward before backward,
    stage order across ranks, no deadlock).
    """
    _check_placement(schedule)
    if not _counts_are_right(schedule):
        _raise_count_error(schedule)
    schedule_graph(schedule).order(schedule.name)
    return schedule
