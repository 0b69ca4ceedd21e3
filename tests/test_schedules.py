import pytest

from pipefisher.core.ir import OpKind, ScheduleError, peak_activations
from pipefisher.schedules import get_schedule
from pipefisher.schedules.validate import validate


def grid_cases():
    for d in range(2, 9):
        for n in range(1, 17):
            yield "gpipe", d, n, None
            yield "1f1b", d, n, None
            if n % d == 0:
                for chunks in (1, 2, 3):
                    yield "interleaved", d, n, chunks
                if d % 2 == 0:
                    yield "chimera", d, n, None


@pytest.mark.parametrize("name, d, n, chunks", list(grid_cases()))
def test_every_generator_validates_over_the_grid(name, d, n, chunks):
    schedule = validate(get_schedule(name, d, n, chunks))
    assert schedule.num_ranks == d
    compute = [op for _, _, op in schedule.ops() if op.kind.is_compute]
    assert len(compute) == 2 * n * schedule.num_stages


def strings(schedule):
    return [" ".join(str(op) for op in ops) for ops in schedule.ranks]


def test_gpipe_small_case():
    assert strings(get_schedule("gpipe", 2, 3)) == [
        "0F0 0F1 0F2 0B0 0B1 0B2",
        "1F0 1F1 1F2 1B0 1B1 1B2",
    ]


def test_1f1b_small_case():
    assert strings(get_schedule("1f1b", 3, 4)) == [
        "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3",
        "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3",
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3",
    ]


def test_interleaved_small_case():
    schedule = get_schedule("interleaved", 2, 2, chunks=2)
    assert schedule.num_stages == 4 and schedule.placement[(0, 3)] == 1
    assert strings(schedule) == [
        "0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1",
        "1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1",
    ]


def test_chimera_small_case_alternates_pipes_as_published():
    schedule = get_schedule("chimera", 4, 4)
    assert schedule.placement[(1, 0)] == 3 and schedule.placement[(0, 0)] == 0
    assert strings(schedule) == [
        "0F0 0F1 p1.3F2 p1.3B2 p1.3F3 p1.3B3 0B0 0B1",
        "1F0 p1.2F2 1F1 p1.2F3 p1.2B2 1B0 p1.2B3 1B1",
        "p1.1F2 2F0 p1.1F3 2F1 2B0 p1.1B2 2B1 p1.1B3",
        "p1.0F2 p1.0F3 3F0 3B0 3F1 3B1 p1.0B2 p1.0B3",
    ]


def test_chimera_concatenates_blocks_for_more_micro_batches():
    schedule = get_schedule("chimera", 4, 8)
    rank0 = strings(schedule)[0].split()
    assert rank0[:8] == ["0F0", "0F1", "p1.3F2", "p1.3B2", "p1.3F3", "p1.3B3", "0B0", "0F4"]
    down = {op.micro_batch for _, _, op in schedule.ops() if op.pipe == 0}
    assert down == {0, 1, 4, 5}


@pytest.mark.parametrize("d, n", [(2, 2), (4, 4), (4, 12), (8, 16), (5, 3)])
def test_1f1b_holds_at_most_d_minus_s_activations_and_gpipe_holds_n(d, n):
    one = get_schedule("1f1b", d, n)
    for stage, ops in enumerate(one.ranks):
        assert peak_activations(ops) == min(d - stage, n)
    for ops in get_schedule("gpipe", d, n).ranks:
        assert peak_activations(ops) == n


@pytest.mark.parametrize(
    "name, d, n, chunks, message",
    [
        ("chimera", 3, 6, None, "must be even"),
        ("chimera", 4, 6, None, "must be a multiple of stages D"),
        ("interleaved", 4, 6, 2, "must be a multiple of stages D"),
        ("interleaved", 4, 8, 0, "chunks must be at least 1"),
        ("1f1b", 4, 0, None, "micro-batches N must be at least 1"),
        ("gpipe", 0, 4, None, "stages D must be at least 1"),
        ("gpipe", 4, 4, 2, "chunks apply to the interleaved schedule only"),
        ("zigzag", 4, 4, None, "unknown schedule 'zigzag'"),
    ],
)
def test_impossible_combinations_raise_clear_errors(name, d, n, chunks, message):
    with pytest.raises(ScheduleError, match=message):
        get_schedule(name, d, n, chunks)


def test_interleaved_with_one_chunk_is_1f1b():
    assert get_schedule("interleaved", 4, 8, chunks=1).ranks == get_schedule("1f1b", 4, 8).ranks


def test_schedules_hold_only_forward_and_backward_ops():
    kinds = {op.kind for _, _, op in get_schedule("chimera", 4, 8).ops()}
    assert kinds == {OpKind.FORWARD, OpKind.BACKWARD}
