import pytest

from pipefisher.ir import ScheduleError, backward, forward
from pipefisher.schedules import get_schedule
from pipefisher.validate import execution_order, schedule_dependencies, validate


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
