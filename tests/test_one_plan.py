"""`pipefisher run` executes the plan `pipefisher plan` predicts for its layout (issue 46, item 4):
both pack through `plan_layout`, so from the same profile the run's refresh interval and predicted
step are the planner's. Before, the run packed the profile as it was (no modelled factor syncs
over Chimera's two pipes or the data-parallel copies, no modelled gradient reductions); on the
shipped 1F1B profile of the BERT demo that gave Chimera + K-FAC k = 10 against the planner's 9,
and 1F1B x DP2 k = 7 against 6 (docs/planner.md, "One plan for plan, pack and run")."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipefisher.config import load_config
from pipefisher.core.ir import OpKind
from pipefisher.methods.registry import task_rules
from pipefisher.core.profile import load_profile
from pipefisher.planning.planner.pack_cache import PACKINGS
from pipefisher.planning.planner.predict import plan_layout, predict
from pipefisher.planning.planner.run_layout import run_layout
from pipefisher.runtime.training.pipefisher_run import make_plan

PROFILE = "profiles/tiny-cpu-1f1b.yaml"


@pytest.mark.parametrize(
    ("schedule", "data_parallel", "method", "section"),
    [
        ("chimera", 1, "kfac", {}),
        ("1f1b", 2, "kfac", {}),
        ("1f1b", 2, "shampoo", {}),
        # Shampoo's helpers: its products in a P op on one pipeline
        ("1f1b", 1, "shampoo", {"shampoo": {"helpers": True}}),
        ("gpipe", 1, "kfac", {}),
        # gradient workers: no P ops, each worker's share and broadcast in the step end
        ("1f1b", 2, "kfac", {"kfac": {"grad_worker_fraction": 0.5}}),
        ("chimera", 1, "muon", {}),
    ],
)
def test_the_run_packs_the_plan_the_planner_predicts(
    schedule: str, data_parallel: int, method: str, section: dict
) -> None:
    # Shampoo's and Muon's profile: the K-FAC profile's times relabelled (planning reads only the times)
    profile = replace(load_profile(PROFILE), method=method)
    config = load_config("schedules/tiny-cpu.yaml").with_overrides(
        pipeline={"schedule": schedule, "data_parallel": data_parallel}, optimizer={"name": method}, **section
    )
    layout, context = run_layout(config, profile, PROFILE)
    predicted = predict(layout, context)
    PACKINGS.clear()  # the run packs on its own, not from the planner's cache
    run = make_plan(config, layout.build_schedule(), profile)
    assert PACKINGS.misses == 1
    assert run.refresh_steps == predicted.layout.refresh_steps
    assert run.predicted_cycle_ms / run.refresh_steps == pytest.approx(predicted.step_ms, rel=1e-9)
    assert run.plan == plan_layout(layout, context)[0].plan
    workers = config.workers_per_layer is not None
    assert (context.workers_per_layer(layout) is not None) == workers
    assert context.precondition_op(layout) == config.precondition_op
    # an optional P op (Shampoo's products) only where the packer found it faster than the step end
    has_p_ops = task_rules(method).precondition and plan_layout(layout, context)[0].options.precondition
    assert any(op.kind is OpKind.PRECONDITION for op in run.plan.curvature_ops()) == has_p_ops
