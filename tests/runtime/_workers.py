"""Module-level functions that spawned ranks run (they must be importable by name)."""

from __future__ import annotations

import os
import signal
import time

import torch

from pipefisher.config import RunConfig
from pipefisher.ir import OpKind
from pipefisher.runtime.training import TrainResult, build_executor, train_pipelined

CPU = torch.device("cpu")


def pipelined(rank: int, world: int, config: RunConfig) -> TrainResult:
    return train_pipelined(config, rank, CPU)


def _break_backward(config: RunConfig, rank: int, fault) -> TrainResult:
    """Train, but rank 1 calls `fault()` at its backward of micro-batch 2 in the second step."""
    executor, _ = build_executor(config, rank, CPU)
    if rank == 1:
        backward = executor.handlers[OpKind.BACKWARD]

        def broken(op):
            if executor.current_step == 1 and op.micro_batch == 2:
                fault()
            return backward(op)

        executor.handlers[OpKind.BACKWARD] = broken
    return train_pipelined(config, rank, CPU, executor=executor)


def _raise() -> None:
    raise ValueError("injected fault")


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def raising(rank: int, world: int, config: RunConfig) -> TrainResult:
    return _break_backward(config, rank, _raise)


def killed(rank: int, world: int, config: RunConfig) -> TrainResult:
    return _break_backward(config, rank, _die)


def failing(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank one is broken")
    time.sleep(60)


def hanging(rank: int, world: int) -> int:
    if rank == 1:
        time.sleep(600)
    return rank


def bert_one_step(rank: int, world: int, config: RunConfig) -> TrainResult:
    return train_pipelined(config, rank, CPU)


def checkpointing(rank: int, world: int, config: RunConfig, resume: bool) -> TrainResult:
    return train_pipelined(config, rank, CPU, resume=resume)


def dies_while_saving(rank: int, world: int, config: RunConfig, fatal_step: int) -> TrainResult:
    """Train with checkpoints; rank 0 is killed half-way through writing the checkpoint of `fatal_step`."""
    from pipefisher.runtime import checkpoint

    original = checkpoint.torch.save

    def save(state, path):
        if rank == 0 and state.get("step") == fatal_step:
            with open(path, "wb") as handle:
                handle.write(b"partial")
            os.kill(os.getpid(), signal.SIGKILL)
        original(state, path)

    checkpoint.torch.save = save
    return train_pipelined(config, rank, CPU)


def profiled_midway(rank: int, world: int, config: RunConfig, profile: bool) -> tuple[list[float], dict]:
    """Two steps, a profile measurement if `profile` (it must leave no trace), two more steps:
    the losses and this rank's final parameters and optimizer state."""
    from pipefisher.runtime.profiler import measure_profile
    from pipefisher.runtime.assembly import staged_model

    executor, schedule = build_executor(config, rank, CPU)
    ops = schedule.ranks[rank]
    losses = [executor.run_step(step, ops).loss for step in range(2)]
    if profile:
        modules = {key: stage.module for key, stage in executor.stages.items()}
        measure_profile(executor, rank, modules, executor.output_shape, config.data.micro_batch_size,
                        skip=staged_model(config).kfac_skip(), repeats=2)
    losses += [executor.run_step(step, ops).loss for step in range(2, 4)]
    state = {f"{key}.{name}": value.detach().clone() for key, stage in executor.stages.items()
             for name, value in stage.module.state_dict().items()}
    state["lr"] = executor.optimizer.param_groups[0]["lr"]
    return losses, state
