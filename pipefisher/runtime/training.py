"""A pipelined training run from a RunConfig: the run's model and data, this rank's executor,
the step loop with checkpoints. `pipefisher.runtime.reference` trains the same in one process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from pipefisher.config import RunConfig
from pipefisher.ir import Schedule
from pipefisher.optim import build_optimizer, build_scheduler
from pipefisher.profile import profile_from_dict
from pipefisher.runtime.assembly import build_schedule, data_source, staged_model
from pipefisher.runtime.comm import Comm
from pipefisher.runtime.checkpoint import latest_step, load_rank, mark_latest, save_rank
from pipefisher.runtime.executor import Executor, StepResult
from pipefisher.runtime.gradients import GradientClipper, TiedGradients
from pipefisher.runtime.stage import StageRuntime
from pipefisher.runtime.topology import Topology

StepCallback = Callable[[StepResult], None]


@dataclass(frozen=True)
class TrainResult:
    """Step losses (identical on every rank) and this rank's parameters, keyed
    ``"<stage>.<name>"`` (for Chimera, ``"p<pipe>.<stage>.<name>"`` for the second pipe's copy)."""

    losses: list[float]
    parameters: dict[str, Tensor]


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
    model = staged_model(config)
    comm = Comm(topology, rank, device)
    num_stages = schedule.num_stages
    modules = {
        (pipe, stage): model.build_stage(stage, num_stages, config.run.seed).to(device)
        for pipe, stage in topology.stages_of(rank)
    }
    tied = TiedGradients(topology, rank, modules, model.tied_parameters())
    tied.create_group()
    stages = {
        key: StageRuntime(key[0], key[1], module, key[1] == 0, key[1] == num_stages - 1, model.loss, 1.0 / topology.total_micro_batches)
        for key, module in modules.items()
    }
    optimizer = build_optimizer(config.optimizer, modules.values())
    executor = Executor(
        topology, rank, stages, comm, data_source(config),
        lambda stage: model.activation_shape(stage, num_stages, config.data.micro_batch_size),
        optimizer, device, loss_parts=model.loss_parts,
    )
    executor.gradient_hooks.append(tied)
    if config.optimizer.clip_norm > 0:
        executor.clipper = GradientClipper(topology, rank, modules, model.tied_parameters(), config.optimizer.clip_norm, device)
    executor.scheduler = build_scheduler(config, optimizer)
    return executor, schedule


def train_pipelined(config: RunConfig, rank: int, device: torch.device, on_step: StepCallback | None = None,
                    executor: Executor | None = None, resume: bool = False) -> TrainResult:
    """Train on this rank (with `executor` if given, else a fresh one from `build_executor`) up
    to `config.run.steps`; with `resume`, continue from the latest checkpoint in
    `config.checkpoint.dir`. Checkpoints are written there every `checkpoint.every` steps and at the end."""
    if executor is None:
        executor, _ = build_executor(config, rank, device)
    start, state = 0, None
    if resume:
        start = latest_step(config.checkpoint.dir, config)
        state = load_rank(config.checkpoint.dir, start, rank, device)
        _restore(executor, state)
    trainer = None
    if config.optimizer.name == "kfac":
        from pipefisher.runtime.pipefisher_run import PipeFisherTrainer

        profile = profile_from_dict(state["kfac"]["profile"]) if state else None
        trainer = PipeFisherTrainer(config, executor, rank, profile)
        if state:
            trainer.load_state_dict(state["kfac"])
        run_step = trainer.run_step
    else:
        ops = executor.topology.schedule.ranks[executor.topology.pipeline_rank(rank)]
        run_step = lambda step: executor.run_step(step, ops)
    losses = []
    every = config.checkpoint.every
    for step in range(start, config.run.steps):
        result = run_step(step)
        losses.append(result.loss)
        if on_step is not None:
            on_step(result)
        done = step + 1
        if config.checkpoint.dir and ((every and done % every == 0) or done == config.run.steps):
            save_rank(config.checkpoint.dir, done, rank, _state(executor, trainer, done))
            dist.barrier()
            if rank == 0:
                mark_latest(config.checkpoint.dir, done, config, config.checkpoint.keep)
    parameters = {}
    for (pipe, stage), runtime in executor.stages.items():
        prefix = f"p{pipe}.{stage}" if pipe else f"{stage}"
        for name, parameter in runtime.module.named_parameters():
            parameters[f"{prefix}.{name}"] = parameter.detach().cpu().clone()
    return TrainResult(losses, parameters)


def _state(executor: Executor, trainer, step: int) -> dict:
    """Everything a rank needs to continue bit for bit after `step` completed steps."""
    return {
        "step": step,
        "stages": {f"{pipe}.{stage}": runtime.module.state_dict() for (pipe, stage), runtime in executor.stages.items()},
        "optimizer": executor.optimizer.state_dict(),
        "scheduler_step": executor.scheduler.last_epoch if executor.scheduler is not None else None,
        "kfac": trainer.state_dict() if trainer is not None else None,
        "rng": torch.random.get_rng_state(),
    }


def _restore(executor: Executor, state: dict) -> None:
    for (pipe, stage), runtime in executor.stages.items():
        runtime.module.load_state_dict(state["stages"][f"{pipe}.{stage}"])
    executor.optimizer.load_state_dict(state["optimizer"])
    if executor.scheduler is not None and state["scheduler_step"] is not None:
        # The schedule comes from this run's configuration; only its position is restored.
        executor.scheduler.last_epoch = state["scheduler_step"] - 1
        executor.scheduler.step()
    torch.random.set_rng_state(state["rng"])
