from dataclasses import replace

import pytest

from pipefisher.core.ir import backward, dependencies, forward
from pipefisher.core.profile import Profile, StageProfile, uniform_profile
from pipefisher.planning.simulate import Interval, OpDurations, simulate, simulate_ops
from pipefisher.schedules import SCHEDULES, get_schedule

from sweeps import micro_batches_for


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("d, n", [(2, 1), (2, 4), (4, 4), (4, 16), (8, 8), (8, 3), (5, 13)])
def test_gpipe_and_1f1b_bubble_fraction_is_exact(name, d, n):
    timeline = simulate(get_schedule(name, d, n), uniform_profile(d, 1.0, 2.0))
    assert timeline.bubble_fraction == pytest.approx((d - 1) / (n + d - 1), abs=1e-12)
    assert timeline.step_time == pytest.approx(3 * (n + d - 1))


@pytest.mark.parametrize("d", [2, 4, 6, 8, 12])
def test_chimera_bubble_fraction_matches_the_paper(d):
    timeline = simulate(get_schedule("chimera", d, d), uniform_profile(d, 1.0, 1.0))
    assert timeline.bubble_fraction == pytest.approx((d - 2) / (2 * d + d - 2), abs=1e-12)


@pytest.mark.parametrize("d, n", [(4, 4), (4, 8), (8, 8), (8, 16)])
def test_chimera_step_is_shorter_than_1f1b(d, n):
    profile = uniform_profile(d, 1.0, 2.0)
    assert (
        simulate(get_schedule("chimera", d, n), profile).step_time
        < simulate(get_schedule("1f1b", d, n), profile).step_time
    )


def test_interleaving_shrinks_the_bubble():
    d, n = 4, 8
    plain = simulate(get_schedule("1f1b", d, n), uniform_profile(d, 1.0, 2.0))
    inter = simulate(get_schedule("interleaved", d, n, 2), uniform_profile(2 * d, 0.5, 1.0))
    assert inter.step_time < plain.step_time
    assert inter.busy_time(0) == pytest.approx(plain.busy_time(0))


@pytest.mark.parametrize("name", SCHEDULES)
def test_timeline_respects_order_dependencies_and_p2p(name):
    schedule = get_schedule(name, 4, micro_batches_for(name, 4, at_least=8))
    stages = tuple(
        StageProfile(forward=1.0 + s / 10, backward=2.0 + s / 7, p2p=0.25) for s in range(schedule.num_stages)
    )
    timeline = simulate(schedule, Profile(stages=stages))
    end = {iv.op: iv.end for ivs in timeline.ranks for iv in ivs}
    start = {iv.op: iv.start for ivs in timeline.ranks for iv in ivs}
    for rank, ivs in enumerate(timeline.ranks):
        assert [iv.op for iv in ivs] == list(schedule.ranks[rank])
        for a, b in zip(ivs, ivs[1:]):
            assert a.end <= b.start + 1e-12
        for iv in ivs:
            for dep in dependencies(iv.op, schedule.num_stages):
                gap = 0.25 if schedule.rank_of(dep) != rank else 0.0
                assert end[dep] + gap <= start[iv.op] + 1e-12


def test_p2p_delays_the_pipeline_fill():
    d, n = 4, 4
    without = simulate(get_schedule("gpipe", d, n), uniform_profile(d, 1.0, 2.0))
    with_p2p = simulate(get_schedule("gpipe", d, n), uniform_profile(d, 1.0, 2.0, p2p=0.5))
    # Forward fill and backward drain each cross D-1 links.
    assert with_p2p.step_time == pytest.approx(without.step_time + 2 * (d - 1) * 0.5)


def test_bubbles_cover_idle_time_exactly():
    timeline = simulate(get_schedule("1f1b", 4, 6), uniform_profile(4, 1.0, 2.0))
    for rank in range(4):
        bubbles = timeline.bubbles(rank)
        assert sum(b.duration for b in bubbles) == pytest.approx(timeline.bubble_time(rank))
        assert all(b.duration > 0 for b in bubbles)
    # The last stage waits D-1 forwards before its first op.
    assert timeline.bubbles(3)[0].start == 0 and timeline.bubbles(3)[0].end == pytest.approx(3.0)


def with_step_ends(profile, step_ends):
    return replace(profile, stages=tuple(replace(s, step_end=e) for s, e in zip(profile.stages, step_ends)))


def test_step_end_extends_the_step_after_each_ranks_last_op():
    d, n = 4, 4
    plain = simulate(get_schedule("gpipe", d, n), uniform_profile(d, 1.0, 2.0))
    # GPipe: rank 0 runs the last backward; rank r's last backward ends 2r earlier.
    assert [plain.last_end(r) for r in range(d)] == pytest.approx([21.0, 19.0, 17.0, 15.0])
    small = simulate(get_schedule("gpipe", d, n), with_step_ends(uniform_profile(d, 1.0, 2.0), [1.5] * d))
    assert small.step_time == pytest.approx(21.0 + 1.5)
    late = simulate(get_schedule("gpipe", d, n), with_step_ends(uniform_profile(d, 1.0, 2.0), [1.5, 0, 0, 9.0]))
    assert late.step_time == pytest.approx(15.0 + 9.0)
    for timeline in (small, late):
        for rank in range(d):
            bubbles = timeline.bubbles(rank)
            assert sum(b.duration for b in bubbles) == pytest.approx(timeline.bubble_time(rank))
            assert max(b.end for b in bubbles) <= timeline.step_time - timeline.tail(rank) + 1e-12
    # Rank 3 ends the step; rank 0 can take 1.5 more work after its last op, and idles 1.5 after its end of step.
    assert late.bubbles(0)[-1].start == pytest.approx(21.0) and late.bubbles(0)[-1].end == pytest.approx(24.0 - 1.5)
    assert late.idle_gaps(0)[-1].start == pytest.approx(22.5) and late.idle_gaps(0)[-1].end == pytest.approx(24.0)
    assert late.idle_gaps(3) == late.bubbles(3)  # no gap after the last op of the rank that ends the step


def test_gradient_reduction_runs_off_the_device_from_the_stages_last_backward():
    """GPipe, 4 stages: rank 3's last backward ends at 15, rank 0's at 21 (its last op). Stage 3's
    all-reduce (7) ends at 22: rank 3 idles from 15 to 22, then spends its step end (1.5)."""
    d, n = 4, 4
    profile = with_step_ends(uniform_profile(d, 1.0, 2.0), [1.5] * d)
    profile = replace(
        profile,
        stages=tuple(replace(stage, grad_reduce=value) for stage, value in zip(profile.stages, [0.5, 0, 0, 7.0])),
    )
    timeline = simulate(get_schedule("gpipe", d, n), profile)
    assert timeline.reduce_ends == pytest.approx((21.5, 19.0, 17.0, 22.0))
    assert [timeline.tail_start(r) for r in range(d)] == pytest.approx([21.5, 19.0, 17.0, 22.0])
    assert timeline.step_time == pytest.approx(22.0 + 1.5)
    assert timeline.busy_time(3) == pytest.approx(4 * 3.0 + 1.5), "the all-reduce does not occupy the device"
    gaps = timeline.idle_gaps(3)
    assert (gaps[-1].start, gaps[-1].end) == pytest.approx((15.0, 22.0)), "waiting for the reduction"
    assert sum(g.duration for g in gaps) == pytest.approx(timeline.bubble_time(3))
    assert sum(g.duration for g in timeline.idle_gaps(0)) == pytest.approx(timeline.bubble_time(0))


def test_a_rank_holding_several_stages_pays_each_stage_end():
    schedule = get_schedule("chimera", 4, 4)
    timeline = simulate(schedule, with_step_ends(uniform_profile(4, 1.0, 1.0), [1.0, 2.0, 4.0, 8.0]))
    # Chimera: rank r holds stage r of the down pipe and stage 3 - r of the up pipe.
    assert timeline.tails == (9.0, 6.0, 6.0, 9.0)
    plain = simulate(schedule, uniform_profile(4, 1.0, 1.0))
    assert timeline.step_time == pytest.approx(max(plain.last_end(r) + timeline.tail(r) for r in range(4)))


def test_profile_with_wrong_stage_count_is_rejected():
    from pipefisher.core.profile import ProfileError

    with pytest.raises(ProfileError, match="one entry per model chunk"):
        simulate(get_schedule("interleaved", 4, 8), uniform_profile(4))


@pytest.mark.parametrize("name", SCHEDULES)
def test_simulate_agrees_with_simulate_ops_and_a_generic_dependency_function(name):
    schedule = get_schedule(name, 4, micro_batches_for(name, 4, at_least=8))
    stages = tuple(
        StageProfile(forward=1.0 + s / 10, backward=2.0 + s / 7, p2p=0.25, step_end=0.1 * s, grad_reduce=0.3 * (s % 3))
        for s in range(schedule.num_stages)
    )
    profile = Profile(stages=stages)
    generic = simulate_ops(
        schedule.ranks, lambda op: dependencies(op, schedule.num_stages), OpDurations(profile), schedule.name
    )
    assert simulate(schedule, profile) == generic


def test_intervals_in_bulk_equal_intervals_one_by_one():
    ops = [forward(0, 0), backward(0, 0)]
    assert Interval.many(ops, [0.0, 1.0], [1.0, 3.0]) == [Interval(ops[0], 0.0, 1.0), Interval(ops[1], 1.0, 3.0)]
