"""A training run from a RunConfig: pipelined on this rank, or the single-process reference.

Both see the same stages (built from the same seeds), the same micro-batches in the same order
and the same loss scaling (mean over all micro-batches of the step), so their losses and
parameters agree to float tolerance.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pipefisher.config import RunConfig
from pipefisher.data.synthetic import SyntheticRegression
from pipefisher.ir import Schedule
from pipefisher.models.tiny import build_stage, stage_output_shape
from pipefisher.optim import build_optimizer
from pipefisher.runtime.comm import Comm
from pipefisher.runtime.executor import Executor, StepResult
from pipefisher.runtime.stage import StageRuntime
from pipefisher.runtime.topology import Topology
from pipefisher.schedules import get_schedule
from pipefisher.validate import validate

StepCallback = Callable[[StepResult], None]


@dataclass(frozen=True)
class TrainResult:
    """Step losses (identical on every rank) and this rank's parameters, keyed
    ``"<stage>.<name>"`` (for Chimera, ``"p<pipe>.<stage>.<name>"`` for the second pipe's copy)."""

    losses: list[float]
    parameters: dict[str, Tensor]


def build_schedule(config: RunConfig) -> Schedule:
    pipeline = config.pipeline
    chunks = pipeline.chunks if pipeline.schedule == "interleaved" else None
    return validate(get_schedule(pipeline.schedule, pipeline.stages, pipeline.micro_batches, chunks))


def mse(output: Tensor, target: Tensor) -> Tensor:
    return nn.functional.mse_loss(output, target)


def build_executor(config: RunConfig, rank: int, device: torch.device) -> tuple[Executor, Schedule]:
    """The executor of `rank` in an initialised process group of `config.world_size` ranks.

    Collective: every rank must call it (it creates the process groups).
    """
    schedule = build_schedule(config)
    topology = Topology(schedule, config.pipeline.data_parallel)
    if dist.get_world_size() != topology.world_size:
        raise RuntimeError(
            f"world size {dist.get_world_size()} != pipeline.stages {config.pipeline.stages} x "
            f"pipeline.data_parallel {config.pipeline.data_parallel}"
        )
    comm = Comm(topology, rank, device)
    data = SyntheticRegression(config.data, config.model)
    num_stages = schedule.num_stages
    stages = {}
    for pipe, stage in topology.stages_of(rank):
        module = build_stage(config.model, stage, num_stages, config.run.seed).to(device)
        stages[(pipe, stage)] = StageRuntime(
            pipe, stage, module, stage == 0, stage == num_stages - 1, mse, 1.0 / topology.total_micro_batches
        )
    optimizer = build_optimizer(config.optimizer, (p for s in stages.values() for p in s.module.parameters()))
    executor = Executor(
        topology, rank, stages, comm, data.micro_batch,
        lambda stage: stage_output_shape(config.model, stage, num_stages, config.data.micro_batch_size),
        optimizer, device,
    )
    return executor, schedule


def train_pipelined(config: RunConfig, rank: int, device: torch.device, on_step: StepCallback | None = None,
                    executor: Executor | None = None) -> TrainResult:
    """Train on this rank (with `executor` if given, else a fresh one from `build_executor`)."""
    if executor is None:
        executor, _ = build_executor(config, rank, device)
    if config.optimizer.name == "kfac":
        from pipefisher.runtime.pipefisher_run import PipeFisherTrainer

        run_step = PipeFisherTrainer(config, executor, rank).run_step
    else:
        ops = executor.topology.schedule.ranks[executor.topology.pipeline_rank(rank)]
        run_step = lambda step: executor.run_step(step, ops)
    losses = []
    for step in range(config.run.steps):
        result = run_step(step)
        losses.append(result.loss)
        if on_step is not None:
            on_step(result)
    parameters = {}
    for (pipe, stage), runtime in executor.stages.items():
        prefix = f"p{pipe}.{stage}" if pipe else f"{stage}"
        for name, parameter in runtime.module.named_parameters():
            parameters[f"{prefix}.{name}"] = parameter.detach().cpu().clone()
    return TrainResult(losses, parameters)


def train_reference(config: RunConfig, on_step: StepCallback | None = None) -> TrainResult:
    """The same training in one process: all stages in sequence, micro-batches in id order."""
    num_stages = config.model_chunks
    stages = [build_stage(config.model, index, num_stages, config.run.seed) for index in range(num_stages)]
    model = nn.Sequential(*stages)
    optimizer = build_optimizer(config.optimizer, model.parameters())
    data = SyntheticRegression(config.data, config.model)
    total = config.pipeline.micro_batches * config.pipeline.data_parallel
    kfac = ReferenceKfac(config, model) if config.optimizer.name == "kfac" else None
    losses = []
    for step in range(config.run.steps):
        start = time.perf_counter()
        step_loss = 0.0
        for micro_batch in range(total):
            inputs, targets = data.micro_batch(step, micro_batch)
            with kfac.capture(step, micro_batch) if kfac else nullcontext():
                loss = mse(model(inputs), targets) * (1.0 / total)  # the scaling the last stage applies
                loss.backward()
            step_loss += float(loss.detach())
        if kfac:
            kfac.before_optimizer_step(step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if kfac:
            kfac.after_optimizer_step(step)
        losses.append(step_loss)
        if on_step is not None:
            on_step(StepResult(step + 1, step_loss, time.perf_counter() - start))
    parameters = {
        f"{index}.{name}": parameter.detach().clone()
        for index, stage in enumerate(stages)
        for name, parameter in stage.named_parameters()
    }
    return TrainResult(losses, parameters)


class ReferenceKfac:
    """K-FAC of the whole model in one process, with the pipeline's cycle semantics: capture in
    the cycle's first step, inverses committed after its last step, preconditioning every step."""

    def __init__(self, config: RunConfig, model: nn.Module):
        from pipefisher.kfac import KFACEngine
        from pipefisher.runtime.kfac_ops import kfac_engine_config, rows_per_step

        if config.kfac.refresh_steps < 1:
            raise ValueError("the reference K-FAC needs kfac.refresh_steps (--kfac-refresh-steps): it has no packer")
        self.k = config.kfac.refresh_steps
        self.lr = config.optimizer.lr
        self.engine = KFACEngine(model, kfac_engine_config(config, rows_per_step(config)))

    def capture(self, step: int, micro_batch: int):
        return self.engine.capture(micro_batch) if step % self.k == 0 else nullcontext()

    def before_optimizer_step(self, step: int) -> None:
        if step % self.k == 0:
            for info in self.engine.layers():
                for factor in ("A", "B"):
                    for micro_batch in self.engine.captured(info.name, factor):
                        self.engine.curvature(info.name, factor, micro_batch)
                    self.engine.invert(info.name, factor)
        self.engine.precondition_all(self.lr)

    def after_optimizer_step(self, step: int) -> None:
        if step % self.k == self.k - 1:
            for info in self.engine.layers():
                self.engine.commit(info.name)
