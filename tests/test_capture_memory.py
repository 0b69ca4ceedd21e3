"""Captures a plan holds per device, and the packer's cap on them."""

from dataclasses import replace

import pytest

from pipefisher.core.ir import OpKind
from pipefisher.core.profile import Profile
from pipefisher.planning.memory.captures import capture_peaks
from pipefisher.planning.packing.pack import PackOptions, after_step_plan, pack
from pipefisher.planning.plan import validate_plan
from pipefisher.schedules import get_schedule

from builders import layered_profile, rules_of
from sweeps import cases

A, B = 3_000_000, 5_000_000  # bytes per micro-batch of one layer's input / output gradient


def profile_with_captures(num_stages: int, layers: int = 2, inverse: float = 0.4) -> Profile:
    return layered_profile(
        num_stages, layers, spread=False, inverse=inverse, inverse_b=inverse / 2, capture_a_bytes=A, capture_b_bytes=B
    )


def replayed_peak(plan, rank: int, profile: Profile) -> int:
    """Independent count: walk the rank's ops, tracking each (layer, micro-batch) capture's state.
    A capture costs extra from its micro-batch's release on (its backward, or its W where the
    schedule splits the backward) until its curvature task, if that has not run before."""
    release = OpKind.WEIGHT if plan.schedule.splits_backward else OpKind.BACKWARD
    held: dict[tuple, int] = {}
    curvature_seen: set[tuple] = set()
    peak = 0
    for index, step in enumerate(plan.steps):
        for op in step[rank]:
            mb_key = (op.pipe, op.stage, op.micro_batch)
            if op.kind is release and index == 0:
                for layer in profile.stages[op.stage].layers:
                    for factor, size in (("A", layer.captured(0)), ("B", layer.captured(1))):
                        if (mb_key, layer.name, factor) not in curvature_seen:
                            held[(mb_key, layer.name, factor)] = size
            elif op.kind is OpKind.CURVATURE:
                factor = "A" if (op.kind, op.part) == (OpKind.CURVATURE, 0) else "B"
                curvature_seen.add((mb_key, op.layer, factor))
                held.pop((mb_key, op.layer, factor), None)
            peak = max(peak, sum(held.values()))
    return peak


@pytest.mark.parametrize("name, d, n", cases((2, range(4, 9)), (4, range(4, 9)), first=True))
def test_peaks_match_an_independent_count(name, d, n):
    schedule = get_schedule(name, d, n)
    profile = profile_with_captures(schedule.num_stages)
    for plan in (
        pack(schedule, profile, rules_of(profile)).plan,
        after_step_plan(schedule, profile, rules_of(profile), 2),
    ):
        peaks = capture_peaks(plan, profile)
        assert [p.bytes for p in peaks] == [replayed_peak(plan, rank, profile) for rank in range(schedule.num_ranks)]


def test_after_step_holds_every_capture_of_the_step():
    schedule = get_schedule("gpipe", 2, 4)
    profile = profile_with_captures(2)
    peaks = capture_peaks(after_step_plan(schedule, profile, rules_of(profile), 1), profile)
    assert [p.bytes for p in peaks] == [4 * 2 * (A + B)] * 2  # 4 micro-batches x 2 layers, all held after the flush


def test_a_capture_cap_moves_curvature_earlier_and_is_met():
    schedule = get_schedule("1f1b", 4, 8)
    profile = profile_with_captures(4, inverse=1.5)
    free = pack(schedule, profile, rules_of(profile))
    assert free.capture_peak_bytes > 0 and free.refresh_steps > 1
    cap_mb = 0.7 * free.capture_peak_bytes / 2**20
    capped = pack(schedule, profile, rules_of(profile), PackOptions(max_capture_mb=cap_mb))
    validate_plan(capped.plan)
    assert capped.capture_peak_bytes <= cap_mb * 2**20
    assert capped.memory.startswith("curvature ") and "right after its forward/backward" in capped.memory
    assert capped.overhead >= free.overhead - 1e-12
    assert capped.to_dict()["capture_peak_mib"] == pytest.approx(capped.capture_peak_bytes / 2**20)


def test_a_cap_that_cannot_be_met_says_so():
    schedule = get_schedule("1f1b", 4, 8)
    profile = profile_with_captures(4, inverse=1.5)
    result = pack(schedule, profile, rules_of(profile), PackOptions(max_capture_mb=0.001))
    validate_plan(result.plan)
    assert "cannot fit" in result.memory and "MiB" in result.memory


def test_unknown_capture_sizes_report_zero():
    schedule = get_schedule("1f1b", 2, 4)
    profile = profile_with_captures(2)
    unknown = replace(
        profile,
        stages=tuple(
            replace(s, layers=tuple(replace(layer, capture_bytes=()) for layer in s.layers)) for s in profile.stages
        ),
    )
    assert pack(schedule, unknown, rules_of(unknown)).capture_peak_bytes == 0


def test_activations_and_captures_are_summed_op_by_op_not_at_their_own_peaks():
    from pipefisher.planning.memory.cycle import cycle_peaks

    schedule = get_schedule("gpipe", 2, 4)
    profile = profile_with_captures(2)
    plan = after_step_plan(schedule, profile, rules_of(profile), 1)
    captured = 4 * 2 * (A + B)  # after the flush, before any curvature task
    # GPipe holds its 4 micro-batches' activations before the first backward, its captures after the last
    joint = cycle_peaks(plan, profile, [10, 100], [0, 0], [0, 0], {})
    assert [(p.activation_bytes, p.capture_bytes) for p in joint] == [(0, captured)] * 2
    joint = cycle_peaks(plan, profile, [10**9, 10**9], [0, 0], [0, 0], {})
    assert [(p.activation_bytes, p.capture_bytes) for p in joint] == [(4 * 10**9, 0)] * 2


def test_a_refresh_copy_is_held_from_the_layers_first_curvature_task_to_the_cycle_end():
    from pipefisher.planning.memory.cycle import cycle_peaks

    schedule = get_schedule("1f1b", 2, 4)
    profile = layered_profile(2, 2, spread=False)  # no capture sizes
    copy = 7_000_000
    refresh = {(stage, layer.name): copy for stage, entry in enumerate(profile.stages) for layer in entry.layers}
    joint = cycle_peaks(
        after_step_plan(schedule, profile, rules_of(profile), 2), profile, [0, 0], [0, 0], [0, 0], refresh
    )
    assert [(p.refresh_bytes, p.total_bytes) for p in joint] == [
        (2 * copy, 2 * copy)
    ] * 2  # both layers of the rank's stage
