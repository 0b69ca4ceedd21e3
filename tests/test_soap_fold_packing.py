"""SOAP's per-step fold (U) in plans: one per (pipe, stage) in every step, in the step's first
bubble that holds it (the last stage's wait for its first forward), else after the step's work.
Nothing waits for it (whatever reads the statistics first folds what is held), so every plan is
valid and simulates without deadlock, whatever the fold costs, on every schedule."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from builders import layered_profile, rules_of
from pipefisher.core.ir import Op, OpKind
from pipefisher.core.profile import LayerProfile, load_profile
from pipefisher.methods.flop_report import flop_report
from pipefisher.planning.packing.pack import pack
from pipefisher.planning.plan import validate_plan
from pipefisher.planning.simulate import OpDurations, simulate
from pipefisher.schedules import SCHEDULES, get_schedule


@pytest.mark.parametrize("fold", [0.0, 0.02, 3.0])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_step_folds_once_per_stage_in_a_valid_plan(schedule, fold):
    pipe = get_schedule(schedule, 4, 8)
    profile = layered_profile(pipe.num_stages, method="soap", curvature=0.0, precondition=0.0, fold=fold / 3)
    result = pack(pipe, profile, rules_of(profile))
    validate_plan(result.plan)
    assert all(timeline.step_time > 0 for timeline in result.timelines)
    for step in result.plan.steps:
        folds = sorted((op.pipe, op.stage) for ops in step for op in ops if op.kind is OpKind.FOLD)
        assert folds == sorted(pipe.placement)


def test_a_fold_that_fits_goes_into_the_first_bubble_and_costs_the_step_nothing():
    """1F1B on 2 stages: the last stage waits for its first forward at the step's start; a fold
    shorter than that wait runs there, and the step with it is the first-order step."""
    pipe = get_schedule("1f1b", 2, 4)
    profile = layered_profile(pipe.num_stages, method="soap", curvature=0.0, precondition=0.0, fold=0.1)
    result = pack(pipe, profile, rules_of(profile))
    kinds = [op.kind for op in result.plan.steps[0][1]]
    assert kinds[0] is OpKind.FOLD and kinds.index(OpKind.FORWARD) > 0
    assert result.precondition_step_time == pytest.approx(simulate(pipe, profile).step_time)
    heavy = layered_profile(pipe.num_stages, method="soap", curvature=0.0, precondition=0.0, fold=2.0)
    assert pack(pipe, heavy, rules_of(heavy)).precondition_step_time > simulate(pipe, heavy).step_time


def test_a_plan_written_before_fold_ops_loads_with_one_at_each_steps_start(tmp_path):
    from pipefisher.methods.registry import task_rules
    from pipefisher.planning.plan import Plan

    pipe = get_schedule("1f1b", 2, 4)
    profile = layered_profile(pipe.num_stages, method="soap", curvature=0.0)
    plan = pack(pipe, profile, rules_of(profile)).plan
    data = plan.to_dict()
    data["steps"] = [
        [[t for t in ops if Op.parse(t).kind is not OpKind.FOLD] for ops in step] for step in data["steps"]
    ]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    loaded = validate_plan(Plan.load(path, task_rules))
    assert all(ops[0].kind is OpKind.FOLD for step in loaded.steps for ops in step)
    assert Plan.load(path, task_rules).steps == loaded.steps


def test_a_fold_op_takes_its_stages_fold_times_which_the_file_keeps_apart_from_precondition(tmp_path):
    """A U op's time is the sum of its stage's layers' `fold` (a P op's is their `precondition`);
    a file keeps both, writes `fold` only where it is not 0, and the FLOP/s report names it."""
    folding = layered_profile(2, method="soap", curvature=0.0, precondition=0.0, fold=5.0)
    preconditioning = layered_profile(2, method="soap", curvature=0.0, precondition=5.0, fold=0.0)
    for stage in range(2):
        fold = Op(OpKind.FOLD, stage, None, 0)
        assert OpDurations(folding)(fold) == pytest.approx(15.0), "3 layers of 5 ms"
        assert OpDurations(preconditioning)(fold) == 0.0
    layer = LayerProfile("w", precondition=0.5, fold=2.0, samples={"fold": [1.5, 2.0, 2.5]}, flops={"fold": 4e9})
    assert layer.to_dict()["fold"] == 2.0 and "fold" not in LayerProfile("w", precondition=0.5).to_dict()
    assert (layer.time("fold"), layer.with_times({"fold": 3.0}).fold) == (2.0, 3.0)
    stages = tuple(replace(stage, layers=(layer,)) for stage in folding.stages)
    path = tmp_path / "soap.yaml"
    replace(folding, stages=stages).save(path)
    loaded = load_profile(path)
    assert loaded.stages[0].layers[0] == layer and loaded.at_percentile(0).stages[1].layers[0].fold == 1.5
    assert "  statistics fold: 8 GFLOP per step in 4.000 ms, 2 TFLOP/s" in "\n".join(flop_report(loaded))
