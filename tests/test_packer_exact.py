"""The exact packer (HiGHS through the optional ``solver`` extra): hand-made cycles with a known
optimum, and the greedy never beating it on small shipped configurations."""

from __future__ import annotations

import pytest

from pipefisher.core.ir import Op, OpKind
from pipefisher.methods.registry import method_of_profile
from pipefisher.planning.packing.exact import CycleModel, Slot, least_added_time, solve_cycle
from pipefisher.planning.packing.pack import PackOptions, pack
from pipefisher.planning.transformer_profile import BERT_SIZES, read_block_times, transformer_profile
from pipefisher.schedules import get_schedule
from pathlib import Path

pytest.importorskip("highspy")


def _model(steps: int, works: list[float], dependencies=(), releases=None) -> CycleModel:
    """One rank; each step (period 4) has one window [0, 2) and the tail after the step's work."""
    slots = []
    for step in range(steps):
        slots.append(Slot(0, step, 2 * step, 4.0 * step, 4.0 * step + 2))
        slots.append(Slot(0, step, 2 * step + 1, 4.0 * (step + 1), 4.0 * (step + 1)))
    ops = tuple(Op(OpKind.CURVATURE, stage=0, micro_batch=0, layer=i, part=0) for i in range(len(works)))
    return CycleModel(
        steps,
        ops,
        (0,) * len(works),
        tuple(works),
        tuple(releases or [0.0] * len(works)),
        tuple(dependencies),
        tuple(slots),
    )


@pytest.mark.parametrize(("steps", "added"), [(1, 3.0), (2, 1.0), (3, 0.0)])
def test_least_added_time_of_a_hand_made_cycle(steps, added):
    """Tasks of 2, 2 and 1 ms, 2 ms of window per step: k = 1 adds 3 ms (one 2 fits), k = 2 adds
    1 ms (both 2s fit), k = 3 adds nothing: the smallest k without added time is 3."""
    total, optimal, _ = least_added_time(_model(steps, [2.0, 2.0, 1.0]), time_limit=10)
    assert optimal and total == pytest.approx(added)


def test_dependencies_and_releases_bind():
    """Task 0 (1 ms) waits for task 1 (2 ms): alone each fits a window, but task 0 cannot go
    before task 1, and with k = 1 only one of them fits the window."""
    assert least_added_time(_model(2, [1.0, 2.0]), 10)[0] == pytest.approx(0.0)
    assert least_added_time(_model(1, [1.0, 2.0], dependencies=[(0, 1)]), 10)[0] == pytest.approx(1.0)
    # a task ready only after the first step's window ended cannot use it
    assert least_added_time(_model(1, [1.0], releases=[2.5]), 10)[0] == pytest.approx(1.0)
    assert least_added_time(_model(2, [1.0], releases=[2.5]), 10)[0] == pytest.approx(0.0)


@pytest.mark.parametrize("schedule_name", ["gpipe", "1f1b"])
def test_the_greedy_never_beats_the_exact_solver(schedule_name):
    blocks, hidden, ffn = BERT_SIZES["bert-base"]
    times = read_block_times(
        Path(__file__).resolve().parents[1] / "profiles" / "reference" / "bert-base_time_memory_p100.csv", 32
    )
    profile = transformer_profile(times, blocks, 4, hidden, ffn, 32, device="P100")
    schedule, rules = get_schedule(schedule_name, 4, 4), method_of_profile(profile).rules
    exact = solve_cycle(schedule, profile, rules, PackOptions(), time_limit=30)
    greedy = pack(schedule, profile, rules, PackOptions())
    pinned = pack(schedule, profile, rules, PackOptions(refresh_steps=exact.refresh_steps))
    assert exact.optimal and exact.fits
    assert greedy.refresh_steps >= exact.refresh_steps
    assert pinned.overhead >= exact.overhead - 1e-9
    assert exact.refresh_steps >= greedy.lower_bound


@pytest.mark.parametrize(
    ("schedule_name", "data_parallel"), [("chimera", 2), ("zb-h1", 1), ("dualpipev", 2), ("interleaved", 1)]
)
def test_a_capture_cap_always_gives_a_valid_plan(schedule_name, data_parallel):
    """The capture cap's placements (curvature confined to early steps, or right after its
    forward/backward) give a plan that runs: no deadlock, collectives in one order per group,
    for schedules with replicated stages and split backwards, at a cap no placement meets."""
    from pipefisher.planning.plan import validate_plan
    from pipefisher.schedules import chunks_per_rank

    blocks, hidden, ffn = BERT_SIZES["bert-base"]
    times = read_block_times(
        Path(__file__).resolve().parents[1] / "profiles" / "reference" / "bert-base_time_memory_p100.csv", 8
    )
    profile = transformer_profile(times, blocks, 2 * chunks_per_rank(schedule_name), hidden, ffn, 8, device="P100")
    schedule, rules = get_schedule(schedule_name, 2, 4), method_of_profile(profile).rules
    result = pack(schedule, profile, rules, PackOptions(data_parallel=data_parallel, max_capture_mb=0.001))
    assert result.memory  # the cap changed the placement, down to curvature right after its forward/backward
    validate_plan(result.plan)
