"""The executor builds the next step's micro-batches at the end of the current one, once this
rank's ops are issued, never past the run's last step; a step started afresh (a resumed run)
reads the same micro-batches as one prepared ahead."""

import pytest
import torch

from pipefisher.runtime.pipeline.batches import prepare
from pipefisher.runtime.pipeline.plan_runner import PlanRunner, schedule_plan
from pipefisher.runtime.training.launch import world_of_one
from pipefisher.runtime.training.trainer import build_executor

pytestmark = pytest.mark.dist
CPU = torch.device("cpu")


def run(config, steps, built, seen):
    """Run `steps` on a fresh one-rank executor; `built` gets (step built, step running, phase)
    per build, `seen` (step, micro-batch, inputs) per forward."""
    executor, schedule = build_executor(config, 0, CPU)
    executor.steps = config.run.steps
    source, runtime = executor.micro_batch, next(iter(executor.stages.values()))
    phase = ["actions"]

    def counted(step, micro_batch):
        built.append((step, executor.current_step, phase[0]))
        return source(step, micro_batch)

    forward = runtime.forward

    def recording(micro_batch, inputs, batch):
        seen.append((executor.current_step, micro_batch, batch["inputs"].clone()))
        phase[0] = "actions"
        return forward(micro_batch, inputs, batch)

    executor.micro_batch, runtime.forward = counted, recording
    end = executor.step_end.finish

    def finishing():
        phase[0] = "end"
        return end()

    executor.step_end.finish = finishing
    prepare_next = executor._prepare

    def preparing(step):
        phase[0] = "ahead"
        prepare_next(step)

    executor._prepare = preparing
    runner = PlanRunner(executor, 0, schedule_plan(schedule), executor.tied)
    for step in steps:
        runner.run_step(step)


def test_the_next_steps_micro_batches_are_built_ahead_and_a_fresh_start_reads_the_same(tiny_config):
    config = tiny_config(schedule="1f1b", stages=1).with_overrides(run={"steps": 3})
    m = config.pipeline.micro_batches
    built, seen, resumed_built, resumed = [], [], [], []
    with world_of_one("gloo", CPU):
        run(config, range(3), built, seen)
        run(config, [2], resumed_built, resumed)
    assert built == [(0, 0, "actions")] * m + [(1, 0, "ahead")] * m + [(2, 1, "ahead")] * m
    assert resumed_built == [(2, 2, "actions")] * m, "nothing is prepared past the last step"
    assert [(step, mb) for step, mb, _ in seen] == [(step, mb) for step in range(3) for mb in range(m)]
    for (_, _, ahead), (_, _, fresh) in zip(seen[-m:], resumed, strict=True):
        assert torch.equal(ahead, fresh)


def test_prepared_batches_have_what_was_read_on_the_device_already():
    def source(step, index):
        return {"a": torch.full((2,), 10.0 * step + index), "b": torch.zeros(1)}

    batches = prepare(source, 3, [1, 0], ["a", "missing"], CPU)
    assert list(batches) == [(3, 1), (3, 0)]
    assert all(list(batch.moved) == ["a"] for batch in batches.values())
    assert torch.equal(batches[(3, 1)]["a"], torch.full((2,), 31.0))
