"""A P op or the step end (`pipefisher.planning.packing.step_end`): Shampoo's products and SOAP's
rotation in run in a P op (which helpers share) only where that shortens the mean step; else the
packer leaves the P ops out and the step end does the work, as it does for a run without helpers.
Before, `<method>.helpers: true` always had P ops, and cost more than helpers off where none paid
(SOAP on ZB-H1 at BERT-Large scale: 3.82 % exposed against 3.35 %)."""

from dataclasses import replace

import pytest

from builders import layered_profile
from pipefisher.config import load_config
from pipefisher.core.ir import OpKind
from pipefisher.methods.registry import task_rules
from pipefisher.planning.packing.pack import PackOptions, pack
from pipefisher.planning.packing.step_end import pack_choosing_p_ops, precondition_in_step_end
from pipefisher.planning.plan import cycle_time, simulate_plan
from pipefisher.planning.planner.candidates import layout_of_run
from pipefisher.planning.planner.flop_times import FlopTimes
from pipefisher.planning.planner.hardware import hardware_of
from pipefisher.planning.planner.model_sizes import model_sizes
from pipefisher.planning.planner.predict import PlanContext, plan_layout, predict
from pipefisher.schedules import get_schedule
from test_helpers_planning import linked_profile

LARGE_RUN = "schedules/bert-large-chimera-8x8.yaml"


def p_ops(plan) -> int:
    return sum(op.kind is OpKind.PRECONDITION for op in plan.curvature_ops())


def test_the_step_end_takes_each_stages_preconditioning_as_the_methods_own():
    profile = layered_profile(2, 3, precondition=0.5, method="soap")
    moved = precondition_in_step_end(profile)
    for before, after in zip(profile.stages, moved.stages):
        assert after.step_end == pytest.approx(before.step_end + 1.5)
        assert after.method_step_end == pytest.approx(before.method_step_end + 1.5)
        assert after.layers == before.layers


@pytest.mark.parametrize("method", ["soap", "shampoo"])
def test_p_ops_that_only_delay_the_step_are_left_out(method):
    """1F1B on 2 stages puts stage 0's P op after the step's last backward: exposed either way,
    and cheaper in the step end (`without`, as a modelled source times it there): no P op, the
    options saying so, the plan timed on the profile without them."""
    schedule = get_schedule("1f1b", 2, 4)
    profile = layered_profile(2, 3, precondition=0.5, method=method)
    cheaper = replace(  # a third of the P ops' 1.5 ms per stage
        profile,
        stages=tuple(
            replace(s, step_end=s.step_end + 0.5, method_step_end=s.method_step_end + 0.5) for s in profile.stages
        ),
    )
    result = pack_choosing_p_ops(schedule, profile, task_rules(method), PackOptions(percentile=None), cheaper)
    assert p_ops(result.plan) == 0 and not result.options.precondition
    assert result.profile is cheaper and "no P ops: " in result.reason
    assert result.cycle_time == pytest.approx(cycle_time(simulate_plan(result.plan, cheaper)))
    kept = pack(schedule, profile, task_rules(method), PackOptions(percentile=None))
    assert p_ops(kept.plan) == 2 * kept.refresh_steps
    assert result.cycle_time / result.refresh_steps < kept.cycle_time / kept.refresh_steps


def test_p_ops_are_kept_where_helpers_shorten_the_step():
    """Stage 0's rotation in (2 ms per layer) shared with rank 1 ends the step sooner than the same
    work in stage 0's step end (the default: the P ops' own times moved there)."""
    schedule, profile = get_schedule("1f1b", 2, 4), linked_profile(method="soap")
    options = PackOptions(percentile=None, helpers=True, refresh_steps=1)
    result = pack_choosing_p_ops(schedule, profile, task_rules("soap"), options)
    assert p_ops(result.plan) == 2 * result.refresh_steps and result.plan.helped and result.options.precondition
    assert result.profile is profile and "P ops kept: " in result.reason


def test_a_method_whose_p_op_is_its_own_packs_once():
    schedule, profile = get_schedule("1f1b", 2, 4), layered_profile(2, 3, precondition=0.5)
    assert not task_rules("kfac").step_end_precondition and task_rules("soap").step_end_precondition
    result = pack_choosing_p_ops(schedule, profile, task_rules("kfac"), PackOptions(percentile=None))
    assert (
        p_ops(result.plan) == 2 * result.refresh_steps
        and result.reason == pack(schedule, profile, task_rules("kfac")).reason
    )


def _large(schedule: str, helpers: bool) -> tuple[PlanContext, object]:
    """The BERT-Large run file's layout on `schedule` (8 stages of 8 micro-batches of 32) with SOAP,
    `fold: bubbles`, `helpers` as given and k = 4, timed by the flop model on an H100."""
    config = load_config(LARGE_RUN).with_overrides(
        pipeline={"schedule": schedule}, soap={"helpers": helpers, "fold": "bubbles", "refresh_steps": 4}
    )
    sizes = model_sizes(config)
    source = FlopTimes.check(sizes, hardware_of("h100"), "fp32", "soap", config.section("soap"))
    layout = layout_of_run(config.pipeline, config.data.micro_batch_size, "soap", 0, 0)
    context = PlanContext(sizes, source, "adamw", config.section("soap"), hardware=hardware_of("h100"))
    return context, replace(layout, refresh_steps=4)


@pytest.mark.parametrize(("schedule", "kept"), [("zb-h1", False), ("1f1b", True)])
def test_the_planner_costs_the_step_end_as_a_run_without_helpers(schedule, kept):
    """The flop model times the work a P op leaves in the step end as the method's counts without
    helpers do (one pass per matrix, not two): on ZB-H1 SOAP's helpers pay nothing and the layout
    predicts what it does without them; on 1F1B they pay, and it predicts less."""
    with_helpers, layout = _large(schedule, True)
    without, _ = _large(schedule, False)
    result, profile = plan_layout(layout, with_helpers)
    assert (p_ops(result.plan) > 0) is kept and bool(result.plan.helped) is kept
    helped, alone = predict(layout, with_helpers), predict(layout, without)
    if kept:
        assert helped.overhead_share < alone.overhead_share - 1e-3
    else:
        assert helped.overhead_share == pytest.approx(alone.overhead_share)
        assert profile == plan_layout(layout, without)[1]


def test_a_runs_log_says_when_its_p_ops_went_to_the_step_end():
    """`pipefisher run` with `soap.helpers: true` and k pinned, on a profile where the rotation in
    saves nothing as a P op (1F1B runs stage 0's after the step's last backward; the tiny K-FAC
    profile's times relabelled), runs no P op and its log says so."""
    from pipefisher.core.profile import load_profile
    from pipefisher.runtime.training.assembly import build_schedule
    from pipefisher.runtime.training.pipefisher_run import make_plan

    profile = replace(load_profile("profiles/tiny-cpu-1f1b.yaml"), method="soap")
    config = load_config("schedules/tiny-cpu.yaml").with_overrides(
        optimizer={"name": "soap"}, soap={"helpers": True, "refresh_steps": 3}
    )
    run = make_plan(config, build_schedule(config), profile)
    assert p_ops(run.plan) == 0 and "; no P ops: the rotation in in the step end, no slower there" in run.summary


def test_a_tie_goes_to_the_step_end():
    """P ops whose work takes as long in the step end (1F1B on 2 stages: stage 0's after the step's
    last backward, stage 1's before stage 0's last backward ends, either way) save nothing: none."""
    schedule, profile = get_schedule("1f1b", 2, 4), layered_profile(2, 3, precondition=0.5, method="soap")
    result = pack_choosing_p_ops(schedule, profile, task_rules("soap"), PackOptions(percentile=None))
    kept = pack(schedule, profile, task_rules("soap"), PackOptions(percentile=None))
    assert result.cycle_time / result.refresh_steps == pytest.approx(kept.cycle_time / kept.refresh_steps)
    assert p_ops(result.plan) == 0 and "no P ops: the rotation in in the step end, no slower" in result.reason
