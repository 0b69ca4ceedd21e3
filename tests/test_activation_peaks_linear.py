"""The fast path of the activation peaks (`activation_rows`: rows traced once per schedule, a
maximum of dot products per call) against the op-by-op count of `activation_held`, over every
registered schedule with random per-stage bytes, with and without transients and sends."""

import random

import pytest

from pipefisher.core.ir import ScheduleError
from pipefisher.planning.comm.send_waits import schedule_send_waits
from pipefisher.planning.memory.activation_rows import STAGE, linear_peaks, rank_rows, schedule_rows
from pipefisher.planning.memory.activations import activation_held, activation_peaks, weighted_micro_batches
from pipefisher.schedules import SCHEDULES, get_schedule

SHAPES = ((2, 4), (4, 8), (4, 12), (3, 9))


def _held_peaks(schedule, stage, pending, transient, sent) -> list[int]:
    """The peaks as `activation_held` counts them op by op."""
    weighted = weighted_micro_batches(schedule)
    waits = schedule_send_waits(schedule) if sent is not None else [None] * schedule.num_ranks
    return [
        max(
            (during for during, _ in activation_held(ops, stage, pending, transient, weighted, sent, waits[rank])),
            default=0,
        )
        for rank, ops in enumerate(schedule.ranks)
    ]


def _schedules(name: str) -> list:
    built = []
    for stages, micro_batches in SHAPES:
        try:
            built.append(get_schedule(name, stages, micro_batches))
        except ScheduleError:
            continue
    return built


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_rows_give_the_op_by_op_peaks(name):
    schedules = _schedules(name)
    assert schedules, f"{name}: no test shape builds"
    draw = random.Random(name)
    for schedule in schedules:
        n = schedule.num_stages
        for trial in range(6):
            # zeros and ties included: a dropped row must never have held the maximum alone
            top = (0, 3, 10**12)[trial % 3]
            stage = [draw.randint(0, top) for _ in range(n)]
            pending = [draw.randint(0, top) for _ in range(n)]
            transient = [draw.randint(0, top) for _ in range(n)]
            sent = [(draw.randint(0, top), draw.randint(0, top)) for _ in range(n)]
            for transient_bytes, sent_bytes in ((transient, sent), (transient, None), ([0] * n, sent)):
                expected = _held_peaks(schedule, stage, pending, transient_bytes, sent_bytes)
                assert linear_peaks(schedule, stage, pending, transient_bytes, sent_bytes) == expected
                assert activation_peaks(schedule, stage, pending, transient_bytes, sent_bytes) == expected


def test_rows_are_traced_once_per_schedule_and_keep_no_dominated_row():
    schedule = get_schedule("gpipe", 2, 4)
    rows = schedule_rows(schedule, True)
    assert schedule_rows(schedule, True) is rows
    assert schedule_rows(schedule, False) is not rows
    for rank in rows:
        for row in rank.rows:
            assert not any(other != row and all(a >= b for a, b in zip(other, row)) for other in rank.rows)
    # GPipe's first rank: four forwards in flight at most
    stage = rows[0].features.index((STAGE, 0))
    assert max(row[stage] for row in rows[0].rows) == 4


def test_other_bytes_take_the_op_by_op_count():
    schedule = get_schedule("1f1b", 2, 4)
    assert linear_peaks(schedule, [10.5, 100], [0, 0], [0, 0], None) is None
    assert linear_peaks(schedule, [-1, 100], [0, 0], [0, 0], None) is None
    assert activation_peaks(schedule, [10.5, 100], [0, 0]) == _held_peaks(schedule, [10.5, 100], [0, 0], [0, 0], None)
    assert activation_peaks(schedule, [-10, 100], [0, 0]) == _held_peaks(schedule, [-10, 100], [0, 0], [0, 0], None)


def test_an_empty_rank_holds_nothing():
    assert rank_rows((), set(), None).peak(([], [], [], [], [])) == 0
