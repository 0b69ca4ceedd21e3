"""`run.tf32`: the executor sets torch's TF32 flag for CUDA float32 products from the run file
(and clears it), the profiler's FLOP/s then take the tf32 peak on CUDA, and a CPU step does not
change."""

import pytest
import torch

from pipefisher.runtime.pipeline.plan_runner import PlanRunner, schedule_plan
from pipefisher.runtime.primitives.tf32 import set_tf32, tf32_enabled
from pipefisher.runtime.training.launch import world_of_one
from pipefisher.runtime.training.task_flops import math_dtype
from pipefisher.runtime.training.trainer import build_executor

pytestmark = pytest.mark.dist
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _restore_tf32():
    before = tf32_enabled()
    yield
    set_tf32(before)


def _one_step(config) -> tuple[bool, list[torch.Tensor]]:
    with world_of_one("gloo", CPU):
        executor, schedule = build_executor(config, 0, CPU)
        enabled = tf32_enabled()
        PlanRunner(executor, 0, schedule_plan(schedule), executor.tied).run_step(0)
        return enabled, [p.detach().clone() for s in executor.stages.values() for p in s.module.parameters()]


def test_the_executor_takes_tf32_from_the_run_and_a_cpu_step_is_the_same(tiny_config):
    config = tiny_config(schedule="1f1b", stages=1, micro_batches=2).with_overrides(
        run={"steps": 1}, optimizer={"name": "kfac"}
    )
    on, with_tf32 = _one_step(config.with_overrides(run={"tf32": True}))
    off, without = _one_step(config)
    assert (on, off) == (True, False)
    assert all(torch.equal(a, b) for a, b in zip(with_tf32, without))


def test_float32_products_count_as_tf32_on_cuda_only_while_it_is_set():
    set_tf32(True)
    assert math_dtype("float32", torch.device("cuda")) == "tf32"
    assert math_dtype("float32", CPU) == "float32" and math_dtype("float64", torch.device("cuda")) == "float64"
    set_tf32(False)
    assert math_dtype("float32", torch.device("cuda")) == "float32"
