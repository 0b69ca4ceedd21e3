"""Muon's help ops on the executor (`muon.helpers`): matrices of a stage orthogonalised on another
rank, their directions and results over the ("help", owner, helper) communicator, equal to the
single-process reference in the in-order gloo mode (NCCL's rule), on the schedules whose stages
each have a precondition op of their own."""

import pytest
import torch

from _workers import pipelined_with_records, unit_profile
from test_curvature_equivalence import PARAMETER_ATOL, STEPS, shipped_defaults
from pipefisher.core.ir import Op, OpKind
from pipefisher.methods.registry import task_rules
from pipefisher.planning.packing.helpers import helped_layers, with_help
from pipefisher.planning.packing.pack import after_step_plan
from pipefisher.planning.plan import validate_plan
from pipefisher.runtime.training.launch import run_group
from pipefisher.runtime.training.pipefisher_run import stage_layer_names
from pipefisher.runtime.training.reference import train_reference
from pipefisher.schedules import get_schedule
from pipefisher.testing.harness import RTOL

pytestmark = pytest.mark.dist


def helped_plan(config, schedule_name: str, stage: int, helper: int, count: int):
    """The after-step plan of `config`'s 2-stage `schedule_name` with the first `count` matrices of
    `stage` (the largest-first order does not matter here) helped by rank `helper`."""
    schedule = get_schedule(schedule_name, 2, 4)
    plan = after_step_plan(schedule, unit_profile(config, 2), task_rules("muon"), 1)
    for name in stage_layer_names(config, stage, 2)[:count]:
        plan = with_help(plan, Op(OpKind.HELP, stage, None, 0, name), helper)
    return validate_plan(plan)


@pytest.mark.parametrize("schedule, stage, helper", [("1f1b", 0, 1), ("zb-h1", 1, 0)])
def test_helped_matrices_train_as_the_reference(schedule, stage, helper, tmp_path):
    """Three matrices of one stage orthogonalised by the other rank, the sweeps' Muon run
    (`test_curvature_equivalence.shipped_defaults`): every step's loss and every parameter equal
    the reference's at the sweeps' tolerances, and both ranks sent the three matrices' directions
    or results on the help communicator in every step."""
    config = shipped_defaults("muon", schedule)
    plan = helped_plan(config, schedule, stage, helper, 3)
    path = tmp_path / "plan.json"
    plan.save(path)
    helped = config.with_overrides(muon={"plan": str(path), "helpers": True})
    runs = run_group(pipelined_with_records, helped.world_size, args=(helped,), timeout=30, deadline=240)
    reference = train_reference(config)
    shapes = [reference.parameters[f"{stage}.{name}"].shape for name, _ in helped_layers(plan)[(0, stage)]]
    matrices_bytes = sum(4 * shape.numel() for shape in shapes)
    for result, records in runs:
        assert [record.get("help_comm_bytes") for record in records] == [matrices_bytes] * STEPS
        torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(reference.losses), rtol=RTOL, atol=0)
        for name, value in result.parameters.items():
            torch.testing.assert_close(value, reference.parameters[name], rtol=RTOL, atol=PARAMETER_ATOL)
