"""Exposed optimizer time, predicted (`PackResult.exposed_share`, `pipefisher pack`) and on
measured op times (`pipefisher.planning.packing.exposed`)."""

from dataclasses import replace

import pytest

from pipefisher.core.ir import Op, OpKind
from pipefisher.planning.packing.exposed import (
    MeasuredDurations,
    exposed_time,
    method_shares,
    op_samples,
)
from pipefisher.planning.packing.pack import PackOptions, pack
from pipefisher.planning.packing.text import format_pack_report
from pipefisher.planning.plan import simulate_plan
from pipefisher.planning.simulate import Interval, OpDurations, Timeline
from pipefisher.schedules import get_schedule

from builders import layered_profile, rules_of


def test_exposed_share_of_1f1b_is_stage_0s_work_after_its_last_backward():
    # 1F1B, D=2, N=4, F=1, B=2: the first-order step is (N + D - 1)(F + B) = 15. Stage 0 runs the
    # last backward (it ends the step); what it must do after it has no bubble to go to: its last
    # micro-batch's B curvature (3 layers x 0.001), B inverses (3 x 0.01) and preconditioning
    # (3 x 0.02). Everything else fits the bubbles.
    schedule = get_schedule("1f1b", 2, 4)
    profile = layered_profile(2, curvature=0.001, inverse=0.01, precondition=0.02, spread=False)
    result = pack(schedule, profile, rules_of(profile), PackOptions(refresh_steps=1))
    assert result.first_order_step_time == 15.0
    assert result.exposed_share == pytest.approx((15 + 0.003 + 0.03 + 0.06) / 15 - 1)
    assert result.to_dict()["exposed_share"] == result.exposed_share
    # stage 0's preconditioning has no bubble after its gradient is final; stage 1's has
    assert [d.precondition_outside for d in result.devices] == pytest.approx([0.06, 0.0])
    assert "exposed optimizer time: 0.62 % of the first-order step" in format_pack_report(result)


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "chimera", "gpipe"])
def test_exposed_share_is_the_cycles_mean_step_over_first_order(name):
    schedule = get_schedule(name, 2, 4)
    profile = layered_profile(2, sync=0.1)
    result = pack(schedule, profile, rules_of(profile))
    steps = [timeline.step_time for timeline in result.timelines]
    assert result.exposed_share == pytest.approx(sum(steps) / len(steps) / result.first_order.step_time - 1)
    # the older figure leaves preconditioning out; the two differ by exactly its share
    preconditioning = result.precondition_step_time / result.first_order_step_time - 1
    assert result.exposed_share == pytest.approx(result.overhead + preconditioning)
    exposed = exposed_time(result.plan, OpDurations(profile, schedule.splits_backward))
    assert exposed.share == pytest.approx(result.exposed_share)
    assert exposed.first_order_step_time == result.first_order_step_time


def test_the_methods_work_in_the_end_of_step_is_exposed_too():
    """Shampoo's and SOAP's preconditioning runs in the end of step (`method_step_end`, part of
    `step_end`): the first-order step is simulated without it, the method's with it, so the share
    counts it where the step end is on the critical path (1F1B: stage 0's, after the last
    backward), on predicted and on measured op times alike."""
    schedule = get_schedule("1f1b", 2, 4)
    base = layered_profile(2, curvature=0.0, inverse=0.01, precondition=0.0, spread=False, method="soap")
    with_step_end = replace(base, stages=tuple(replace(s, step_end=1.0) for s in base.stages))
    method_part = replace(base, stages=tuple(replace(s, step_end=1.0, method_step_end=0.6) for s in base.stages))
    plain, counted = (
        pack(schedule, p, rules_of(p), PackOptions(refresh_steps=1)) for p in (with_step_end, method_part)
    )
    assert plain.plain_first_order_step_time == plain.first_order_step_time == counted.first_order_step_time
    assert counted.plain_first_order_step_time == pytest.approx(plain.first_order_step_time - 0.6)
    assert counted.exposed_share == pytest.approx(counted.step_time / (plain.first_order_step_time - 0.6) - 1)
    assert "first-order step without SOAP's end-of-step work 15.4 ms" in format_pack_report(counted)
    samples = op_samples(
        iv for timeline in simulate_plan(counted.plan, method_part) for ivs in timeline.ranks for iv in ivs
    )
    measured = exposed_time(counted.plan, MeasuredDurations(method_part, samples))
    assert measured.first_order_step_time == pytest.approx(counted.plain_first_order_step_time)
    assert measured.share == pytest.approx(counted.exposed_share)


def test_measured_op_times_replace_the_profiles():
    schedule = get_schedule("1f1b", 2, 4)
    truth = layered_profile(2, forward=1.5, backward=2.5, inverse=0.2)
    plan = pack(schedule, truth, rules_of(truth)).plan
    expected = exposed_time(plan, OpDurations(truth))
    # a profile with other times: every op the "measurement" ran takes its measured time instead
    wrong = layered_profile(2, forward=1.0, backward=2.0, inverse=0.9, curvature=0.3, precondition=0.5)
    truth_steps = simulate_plan(plan, truth)
    samples = op_samples(iv for timeline in truth_steps for ivs in timeline.ranks for iv in ivs)
    assert not any(kind in (OpKind.SYNC, OpKind.EXCHANGE) for kind, *_ in samples)
    measured = exposed_time(plan, MeasuredDurations(wrong, samples))
    assert measured.step_time == pytest.approx(expected.step_time)
    assert measured.first_order_step_time == pytest.approx(expected.first_order_step_time) == 4 * 5
    assert exposed_time(plan, OpDurations(wrong)).share != pytest.approx(expected.share)


def test_method_shares_split_method_time_at_the_first_order_bubble():
    first_order = Timeline(
        ranks=(
            (Interval(Op(OpKind.FORWARD, 0, 0), 0.0, 1.0), Interval(Op(OpKind.BACKWARD, 0, 0), 4.0, 6.0)),
            (Interval(Op(OpKind.FORWARD, 1, 0), 1.0, 2.0), Interval(Op(OpKind.BACKWARD, 1, 0), 2.0, 4.0)),
        )
    )
    step = Timeline(
        ranks=(
            first_order.ranks[0] + (Interval(Op(OpKind.PRECONDITION, 0), 6.0, 6.5),),
            first_order.ranks[1]
            + (Interval(Op(OpKind.CURVATURE, 1, 0, layer="l", part=1), 4.0, 5.5),)
            + (Interval(Op(OpKind.PRECONDITION, 1), 5.5, 6.5),),
        )
    )
    # the first-order step ends at 6: rank 0's preconditioning after its last backward is all
    # exposed; of rank 1's 2.5, the 0.5 past 6 is, the 2 in its first-order bubble are hidden
    shares = method_shares(step, first_order)
    assert [(s.rank, s.method, s.hidden, s.exposed) for s in shares] == [(0, 0.5, 0.0, 0.5), (1, 2.5, 2.0, 0.5)]
    assert all(s.hidden + s.exposed == s.method for s in shares)
    early = Timeline(
        ranks=(first_order.ranks[0] + (Interval(Op(OpKind.PRECONDITION, 0), 1.0, 2.0),), first_order.ranks[1])
    )
    assert [(s.method, s.hidden, s.exposed) for s in method_shares(early, first_order)] == [(1.0, 1.0, 0.0), (0, 0, 0)]
