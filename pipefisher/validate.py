"""Schedule checks: placement, op counts, and a dependency-respecting dry run (no deadlock)."""

from __future__ import annotations

from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterator, Sequence

from pipefisher.ir import Op, OpKind, Schedule, ScheduleError, dependencies, format_grid


DependencyFn = Callable[[Op], tuple[Op, ...]]


def _fail(name: str, ranks: Sequence[Sequence[Op]], message: str, marks: list[tuple[int, int]]) -> ScheduleError:
    return ScheduleError(f"{name}: {message}\n{format_grid(ranks, marks)}")


def execution_order(
    ranks: Sequence[Sequence[Op]], deps: DependencyFn, name: str = "schedule"
) -> Iterator[tuple[int, Op, tuple[Op, ...]]]:
    """Yield (rank, op, its dependencies) in an order where every op follows its dependencies.

    Each rank runs its list in order; an op waits until the ops `deps(op)` names have run (on any
    rank). Raises ScheduleError (with the grid, stuck ops marked) if the lists deadlock.
    """
    positions = [0] * len(ranks)
    done: set[Op] = set()
    waiting: dict[Op, list[int]] = defaultdict(list)
    ready = deque(range(len(ranks)))
    while ready:
        rank = ready.popleft()
        ops = ranks[rank]
        while positions[rank] < len(ops):
            op = ops[positions[rank]]
            op_deps = deps(op)
            missing = next((dep for dep in op_deps if dep not in done), None)
            if missing is not None:
                waiting[missing].append(rank)
                break
            yield rank, op, op_deps
            done.add(op)
            ready.extend(waiting.pop(op, ()))
            positions[rank] += 1
    stuck = [(rank, pos) for rank, pos in enumerate(positions) if pos < len(ranks[rank])]
    if stuck:
        reasons = []
        for rank, pos in stuck:
            op = ranks[rank][pos]
            missing = [str(dep) for dep in deps(op) if dep not in done]
            reasons.append(f"rank {rank} waits at {op} for {', '.join(missing)}")
        raise _fail(name, ranks, "deadlock: " + "; ".join(reasons), stuck)


def schedule_dependencies(schedule: Schedule) -> DependencyFn:
    """The dependency function of a plain schedule (forward/backward order across stages)."""
    return lambda op: dependencies(op, schedule.num_stages)


def _check_placement(schedule: Schedule) -> None:
    expected = {(pipe, stage) for pipe in range(schedule.num_pipes) for stage in range(schedule.num_stages)}
    if set(schedule.placement) != expected:
        missing = sorted(expected - set(schedule.placement))
        extra = sorted(set(schedule.placement) - expected)
        raise ScheduleError(f"{schedule.name}: placement must map every (pipe, stage); missing {missing}, unexpected {extra}")
    for (pipe, stage), rank in schedule.placement.items():
        if not 0 <= rank < schedule.num_ranks:
            raise ScheduleError(f"{schedule.name}: pipe {pipe} stage {stage} placed on rank {rank}, but there are {schedule.num_ranks} ranks")
    for rank, position, op in schedule.ops():
        if op.pipe >= schedule.num_pipes or op.stage >= schedule.num_stages:
            raise _fail(schedule.name, schedule.ranks, f"op {op} names a pipe or stage outside the schedule", [(rank, position)])
        home = schedule.placement[(op.pipe, op.stage)]
        if home != rank:
            raise _fail(schedule.name, schedule.ranks, f"op {op} is on rank {rank} but its stage lives on rank {home}", [(rank, position)])


def _check_counts(schedule: Schedule) -> None:
    seen: Counter[Op] = Counter()
    pipe_of_micro_batch: dict[int, int] = {}
    for rank, position, op in schedule.ops():
        seen[op] += 1
        if seen[op] > 1:
            raise _fail(schedule.name, schedule.ranks, f"op {op} appears more than once", [(rank, position)])
        if op.micro_batch is None:
            continue
        if not 0 <= op.micro_batch < schedule.num_micro_batches:
            raise _fail(schedule.name, schedule.ranks, f"op {op}: micro-batch outside 0..{schedule.num_micro_batches - 1}", [(rank, position)])
        owner = pipe_of_micro_batch.setdefault(op.micro_batch, op.pipe)
        if owner != op.pipe:
            raise _fail(schedule.name, schedule.ranks, f"op {op}: micro-batch {op.micro_batch} already belongs to pipe {owner}", [(rank, position)])
    for mb in range(schedule.num_micro_batches):
        pipe = pipe_of_micro_batch.get(mb)
        if pipe is None:
            raise _fail(schedule.name, schedule.ranks, f"micro-batch {mb} is never processed", [])
        for stage in range(schedule.num_stages):
            for kind in (OpKind.FORWARD, OpKind.BACKWARD):
                op = Op(kind, stage, mb, pipe)
                if op not in seen:
                    raise _fail(schedule.name, schedule.ranks, f"op {op} is missing", [])


def validate(schedule: Schedule) -> Schedule:
    """Check that `schedule` can run; return it unchanged or raise ScheduleError.

    Checks: every (pipe, stage) has a rank and its ops sit on that rank; every micro-batch
    belongs to one pipe and gets exactly one forward and one backward per stage; the per-rank
    lists run to completion when each op waits for its dependencies (forward before backward,
    stage order across ranks, no deadlock).
    """
    _check_placement(schedule)
    _check_counts(schedule)
    for _ in execution_order(schedule.ranks, schedule_dependencies(schedule), schedule.name):
        pass
    return schedule
