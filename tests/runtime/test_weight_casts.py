"""Under bf16 a pipelined step casts each weight to bf16 once, whatever its micro-batches (the
reference, one autocast region per stage and micro-batch, casts it once per micro-batch), with
activation recompute too, and the optimizer step ends the casts' life; bf16 runs with split
backward and recompute still equal the reference."""

import pytest
import torch
from torch import nn

from _workers import pipelined_with_records
from pipefisher.runtime.pipeline.plan_runner import PlanRunner, schedule_plan
from pipefisher.runtime.training.launch import run_group, world_of_one
from pipefisher.runtime.training.reference import train_reference
from pipefisher.runtime.training.trainer import build_executor
from pipefisher.testing.casts import WeightCasts
from test_precision import assert_close_training

pytestmark = pytest.mark.dist
CPU = torch.device("cpu")
MICRO_BATCHES = 4


def bf16_config(tiny_config, recompute: str = "none", **overrides):
    return tiny_config(schedule="1f1b", stages=1, micro_batches=MICRO_BATCHES).with_overrides(
        run={"precision": "bf16", "steps": 2, **overrides}, model={"recompute": recompute}
    )


@pytest.mark.parametrize("recompute", ["none", "blocks"])
def test_a_bf16_step_casts_each_weight_once_and_the_reference_once_per_micro_batch(recompute, tiny_config):
    config = bf16_config(tiny_config, recompute)
    with world_of_one("gloo", CPU):
        executor, schedule = build_executor(config, 0, CPU)
        runner = PlanRunner(executor, 0, schedule_plan(schedule), executor.tied)
        names = {
            id(parameter): name
            for runtime in executor.stages.values()
            for name, parameter in runtime.module.named_parameters()
        }
        linear = {
            f"{module_name}.{name}"
            for runtime in executor.stages.values()
            for module_name, module in runtime.module.named_modules()
            if isinstance(module, nn.Linear)
            for name, _ in module.named_parameters()
        }
        steps = []
        for step in range(2):
            with WeightCasts() as casts:
                runner.run_step(step)
            steps.append({names[key]: count for key, count in casts.counts.items()})
    assert steps[0] == dict.fromkeys(linear, 1), "one cast per weight and step"
    assert steps[1] == steps[0], "the next step casts the updated weights afresh"
    with WeightCasts() as casts:
        train_reference(config.with_overrides(run={"steps": 1}))
    assert sorted(casts.counts.values()) == [MICRO_BATCHES] * len(linear)


def test_the_cast_scope_is_closed_after_a_step_and_autocast_off_outside_the_forwards(tiny_config):
    config = bf16_config(tiny_config)
    seen = []
    with world_of_one("gloo", CPU):
        executor, schedule = build_executor(config, 0, CPU)
        runtime = next(iter(executor.stages.values()))
        backward = runtime.backward

        def recording(micro_batch, grad_output=None):
            seen.append(torch.is_autocast_enabled("cpu"))
            return backward(micro_batch, grad_output)

        runtime.backward = recording
        PlanRunner(executor, 0, schedule_plan(schedule), executor.tied).run_step(0)
        assert not torch.is_autocast_enabled("cpu")
        # the step's region has exited: a region opened now is the outermost, and clears on exit
        assert torch.autocast_increment_nesting() == 1
        torch.autocast_decrement_nesting()
    assert seen == [False] * MICRO_BATCHES


@pytest.mark.parametrize("schedule, recompute", [("zb-h1", "selective"), ("1f1b", "blocks")])
def test_bf16_runs_with_recompute_and_split_backward_equal_the_reference(schedule, recompute, tiny_config):
    config = tiny_config(schedule=schedule).with_overrides(
        run={"precision": "bf16"}, model={"recompute": recompute}, optimizer={"clip_norm": 0.5}
    )
    runs = run_group(pipelined_with_records, 2, args=(config,), timeout=30, deadline=120)
    assert_close_training([result for result, _ in runs], train_reference(config), rtol=1e-4)
