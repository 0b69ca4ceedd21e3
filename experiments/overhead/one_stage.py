"""The one-stage arms, each one training run in this process that `step()` advances by one step
(reading the step's loss to the host, as pipefisher does to report it):

`PlainLoop`: the loop the PyTorch docs teach, on the whole model built by pipefisher's staged
model (`build_stage(0, 1, seed)`): per micro-batch, build it once and move it with `.to(device)`,
forward and loss under `torch.autocast` (bf16 runs), backward of loss / M; then
`clip_grad_norm_` (when the run clips), `optimizer.step()`, the learning-rate scheduler,
`zero_grad(set_to_none=True)`. The optimizer and scheduler are the ones pipefisher builds for
the run (`build_optimizer`, `build_scheduler`: AdamW fused, or pipefisher's LAMB).

`PipefisherOneStage`: pipefisher's executor and plan runner (what `train_pipelined` runs) with
pipeline.stages = 1, in a process group of this process alone (`world_of_one`).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Protocol

import torch

from pipefisher.config import RunConfig
from pipefisher.runtime.training import (
    PlanRunner,
    build_executor,
    build_optimizer,
    build_run,
    build_scheduler,
    schedule_plan,
)


class Arm(Protocol):
    def step(self) -> float:
        """Train the next step; its loss (mean over the micro-batches)."""


def compiled(module: torch.nn.Module) -> int:
    """Compile `module`'s blocks in place with pipefisher's `compile_blocks`; how many it compiled."""
    from pipefisher.runtime.training import compile_blocks

    return compile_blocks(module)


class PlainLoop:
    def __init__(self, config: RunConfig, device: torch.device, compile_blocks: bool = False):
        run = build_run(config)
        self.model = run.model
        self.module = self.model.build_stage(0, 1, config.run.seed).to(device)
        if compile_blocks:
            compiled(self.module)
        self.optimizer = build_optimizer(config, [self.module])
        self.scheduler = build_scheduler(config, self.optimizer)
        self.batch = run.data_source
        self.device, self.micro_batches, self.clip = device, config.pipeline.micro_batches, config.optimizer.clip_norm
        bf16 = config.run.precision == "bf16"
        self.autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16 else nullcontext
        self.index = 0

    def step(self) -> float:
        step_loss = torch.zeros((), device=self.device)
        for micro_batch in range(self.micro_batches):
            batch = {name: tensor.to(self.device) for name, tensor in self.batch(self.index, micro_batch).items()}
            with self.autocast():
                loss, _ = self.model.loss(self.module(None, batch), batch)
            (loss / self.micro_batches).backward()
            step_loss += loss.detach() / self.micro_batches
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.clip)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.index += 1
        return float(step_loss)


class PipefisherOneStage:
    """Needs a process group of one (`pipefisher.runtime.training.launch.world_of_one`)."""

    def __init__(self, config: RunConfig, device: torch.device):
        executor, schedule = build_executor(config, 0, device)
        self.runner = PlanRunner(executor, 0, schedule_plan(schedule), executor.tied)
        self.index = 0

    def step(self) -> float:
        result = self.runner.run_step(self.index)
        self.index += 1
        return result.loss


def alternating_steps(arms: dict[str, Arm], steps: int, device: torch.device) -> dict[str, float]:
    """Seconds each of `arms` takes for its next `steps` steps, run in turns (one step of each, in
    the dict's order, `steps` times), so that the load of other processes falls on all alike; the
    device idle at both ends of every step."""
    seconds = dict.fromkeys(arms, 0.0)
    for _ in range(steps):
        for name, arm in arms.items():
            seconds[name] += timed_steps(arm, 1, device)
    return seconds


def timed_steps(arm: Arm, steps: int, device: torch.device) -> float:
    """Seconds `arm` takes for its next `steps` steps, the device idle at both ends."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        arm.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start
