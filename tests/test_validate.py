import gc
import weakref

import pytest

from pipefisher.core.ir import ScheduleError, backward, dependencies, forward
from pipefisher.schedules import SCHEDULES, get_schedule
from pipefisher.schedules.validate import (
    StageDependencies,
    execution_order,
    schedule_dependencies,
    schedule_graph,
    validate,
)

from sweeps import micro_batches_for


def edited(schedule, rank, ops):
    ranks = [list(r) for r in schedule.ranks]
    ranks[rank] = ops
    return schedule.with_ranks(ranks)


def test_backward_before_its_forward_is_rejected_with_the_op_marked():
    s = get_schedule("1f1b", 2, 2)
    broken = edited(s, 1, [backward(1, 0), forward(1, 0), forward(1, 1), backward(1, 1)])
    with pytest.raises(ScheduleError) as info:
        validate(broken)
    message = str(info.value)
    assert "deadlock" in message and "rank 1 waits at 1B0 for 1F0" in message
    assert ">1B0<" in message and "rank  0:" in message


def test_cross_rank_cycle_is_a_deadlock():
    s = get_schedule("gpipe", 2, 2)
    # rank 0 waits for a backward before it sends the forward rank 1 needs.
    broken = edited(s, 0, [forward(0, 0), backward(0, 0), forward(0, 1), backward(0, 1)])
    broken = edited(broken, 1, [forward(1, 1), forward(1, 0), backward(1, 0), backward(1, 1)])
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(broken)


def test_duplicate_op_is_rejected():
    s = get_schedule("gpipe", 2, 2)
    broken = edited(s, 0, list(s.ranks[0]) + [forward(0, 0)])
    with pytest.raises(ScheduleError, match="0F0 appears more than once") as info:
        validate(broken)
    assert ">0F0<" in str(info.value)


def test_missing_op_is_rejected():
    s = get_schedule("gpipe", 2, 2)
    broken = edited(s, 1, list(s.ranks[1])[:-1])
    with pytest.raises(ScheduleError, match="1B1 is missing"):
        validate(broken)


def test_op_on_the_wrong_rank_is_rejected():
    s = get_schedule("gpipe", 2, 1)
    broken = s.with_ranks([list(s.ranks[0]) + [forward(1, 0)], [backward(1, 0)]])
    with pytest.raises(ScheduleError, match="on rank 0 but its stage lives on rank 1"):
        validate(broken)


def test_micro_batch_outside_the_step_is_rejected():
    s = get_schedule("gpipe", 1, 1)
    broken = s.with_ranks([[forward(0, 0), backward(0, 0), forward(0, 5)]])
    with pytest.raises(ScheduleError, match="outside 0..0"):
        validate(broken)


def test_execution_order_respects_dependencies():
    s = get_schedule("chimera", 4, 8)
    seen = set()
    for _, op, _ in execution_order(s.ranks, schedule_dependencies(s)):
        if op.kind.name == "BACKWARD":
            assert forward(op.stage, op.micro_batch, op.pipe) in seen
        seen.add(op)
    assert len(seen) == sum(len(r) for r in s.ranks)


@pytest.mark.parametrize("name", SCHEDULES)
def test_plain_dependencies_run_in_the_order_a_generic_dependency_function_gives(name):
    s = get_schedule(name, 4, micro_batches_for(name, 4, at_least=8))
    generic = list(execution_order(s.ranks, lambda op: dependencies(op, s.num_stages)))
    assert list(execution_order(s.ranks, schedule_dependencies(s))) == generic


@pytest.mark.parametrize("plain", [True, False])
def test_a_dependency_that_no_list_holds_is_a_deadlock_naming_it(plain):
    deps = StageDependencies(2) if plain else (lambda op: dependencies(op, 2))
    with pytest.raises(ScheduleError, match="rank 0 waits at 0B0 for 0F0, 1B0"):
        list(execution_order([[backward(0, 0)]], deps))


@pytest.mark.parametrize("plain", [True, False])
def test_a_repeated_op_runs_at_each_of_its_places(plain):
    deps = StageDependencies(1) if plain else (lambda op: dependencies(op, 1))
    ops = [forward(0, 0), forward(0, 0), backward(0, 0)]
    assert [op for _, op, _ in execution_order([ops], deps)] == ops


def test_a_schedule_is_numbered_once_and_its_graph_dropped_with_it():
    s = get_schedule("1f1b", 4, 8)
    graph = schedule_graph(s)
    assert schedule_graph(s) is graph and schedule_graph(validate(s)) is graph
    dropped = weakref.ref(graph)
    del s, graph
    gc.collect()
    assert dropped() is None
