"""A pipelined training run from a RunConfig: the run's model and data, this rank's executor,
the step loop with checkpoints. `pipefisher.runtime.training.reference` trains the same in one process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from pipefisher.config import RunConfig
from pipefisher.core.ir import Schedule
from pipefisher.core.profile import profile_from_dict
from pipefisher.core.settings import ConfigError
from pipefisher.core.topology import Topology
from pipefisher.methods.registry import method_of
from pipefisher.models.init import derive_seed
from pipefisher.models.tensor_parallel import gather_parameters, parallelize
from pipefisher.runtime.training.optimizer import build_optimizer, build_scheduler
from pipefisher.planning.comm.plan import group_members
from pipefisher.runtime.gradient_path.buffers import GlobalNorm, GradientBuffer, Ownership, TiedGradients
from pipefisher.runtime.gradient_path.precision import LossScaler, Precision
from pipefisher.runtime.gradient_path.reduction import gradient_reduction
from pipefisher.runtime.gradient_path.sharded import FsdpReduction, ShardedNorm, localized
from pipefisher.runtime.primitives.tf32 import set_tf32
from pipefisher.runtime.primitives.sharding import full
from pipefisher.runtime.gradient_path.step_end import Gradients, LossReport, OptimizerStep, StepEnd
from pipefisher.runtime.primitives.comm import TENSOR, Comm
from pipefisher.runtime.pipeline.compiled import compile_blocks
from pipefisher.runtime.pipeline.executor import Executor, StepResult
from pipefisher.runtime.pipeline.extension import Extensions
from pipefisher.runtime.pipeline.plan_runner import PlanRunner, schedule_plan
from pipefisher.runtime.primitives.recompute import recompute_modules
from pipefisher.runtime.pipeline.stage import StageRuntime
from pipefisher.runtime.training.assembly import RunParts, build_run
from pipefisher.runtime.training.evaluation import TrainingClock, pipeline_evaluation
from pipefisher.runtime.training.fsdp_wrap import shard_stages
from pipefisher.runtime.training.checkpoint import StateReader, commit, save_rank, tensor_bytes
from pipefisher.runtime.training.checkpoint_state import (
    entries_to_write,
    process_state,
    restore_curvature,
    restore_executor,
    tied_aliases,
)
from pipefisher.runtime.training.resumption import manifest_fields, resumption
from pipefisher.runtime.signals import stop_request
from pipefisher.runtime.training.stopping import Stopped
from pipefisher.runtime.training.tracing import StepTracer

StepCallback = Callable[[StepResult], None]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainResult:
    """Step losses (identical on every rank) and parameters: a pipelined rank's keyed
    ``"<stage>.<name>"`` (for Chimera, ``"p<pipe>.<stage>.<name>"`` for the second pipe's copy);
    the reference's as `train_reference` says. `state_bytes`: per global rank, the bytes of its
    optimizer state (``optimizer``), of its curvature method's state (``curvature``) and of
    PowerSGD's (``compression``) at the end (empty for the reference)."""

    losses: list[float]
    parameters: dict[str, Tensor]
    state_bytes: tuple[dict[str, int], ...] = ()


def build_executor(
    config: RunConfig, process: int, device: torch.device, run: RunParts | None = None
) -> tuple[Executor, Schedule]:
    """The executor of global process `process` in an initialised process group of
    `config.world_size` processes (the rank and tensor-parallel shard it is:
    `pipefisher.core.topology`), its stages' repeated blocks compiled under `run.compile`
    (`pipefisher.runtime.pipeline.compiled`); its model, schedule and data from `run`, the run's
    parts (default: `build_run(config)`).

    Collective: every process must call it (it creates the process groups). Sets torch's
    process-wide TF32 flag to `run.tf32` (`pipefisher.runtime.primitives.tf32`).
    """
    set_tf32(config.run.tf32)
    run = run if run is not None else build_run(config)
    schedule = run.schedule
    topology = Topology(schedule, config.pipeline.data_parallel, config.pipeline.tensor_parallel)
    if dist.get_world_size() != topology.processes:
        raise RuntimeError(
            f"world size {dist.get_world_size()} != pipeline.stages {config.pipeline.stages} x "
            f"pipeline.data_parallel {config.pipeline.data_parallel} x pipeline.tensor_parallel {topology.tensor_parallel}"
        )
    rank, shard = topology.rank_of_process(process)
    model = run.model
    tied = has_tied_weights(model, schedule)
    path = config.gradient_path
    members = group_members(topology, tied, path, helpers=config.curvature is not None and config.curvature.helpers)
    mesh = device_mesh(topology, device) if topology.tensor_parallel > 1 else None
    comm = Comm(
        members,
        rank,
        in_order=config.run.in_order,
        timeout=config.run.timeout,
        topology=topology,
        shard=shard,
        tensor_group=mesh.get_group("tensor") if mesh is not None else None,
    )
    num_stages = schedule.num_stages
    modules = {}
    for pipe, stage in topology.stages_of(rank):
        module = model.build_stage(stage, num_stages, config.run.seed)
        if mesh is not None:
            parallelize(
                module, model.tensor_parallel_plan(topology.tensor_parallel), mesh["tensor"], comm.tensor_all_reduce
            )
        recompute_modules(module, run.recompute, announce=not config.run.compile)
        modules[(pipe, stage)] = module.to(device)
    if path.fsdp:
        shard_stages(modules, comm, device, config.optimizer.zero, schedule.num_pipes)
    if config.run.compile:
        for module in modules.values():
            compile_blocks(module)
    # this rank's dropout, on every device; a rank's tensor-parallel processes draw the same masks
    torch.manual_seed(derive_seed(config.run.seed, f"rank/{rank}"))
    precision = Precision(config.run.precision, device, step_cache=not path.fsdp)
    scaler = LossScaler(config.run.loss_scale, device) if precision.name == "fp16" else None
    grad_scale = (lambda: scaler.scale) if scaler is not None else (lambda: None)
    stages = {
        key: StageRuntime(
            key[0],
            key[1],
            module,
            key[1] == 0,
            key[1] == num_stages - 1,
            model.loss,
            1.0 / topology.total_micro_batches,
            precision,
            grad_scale,
        )
        for key, module in modules.items()
    }
    extensions = Extensions()
    step_end = build_step_end(config, topology, (rank, shard), comm, device, stages, model, members, scaler, extensions)
    micro_batch_size = config.data.micro_batch_size

    def message_spec(message):
        return model.activation_shape(message.lower_stage, num_stages, micro_batch_size), precision.compute_dtype

    executor = Executor(
        topology,
        rank,
        stages,
        comm,
        run.data_source,
        message_spec,
        step_end,
        device,
        tied=tied,
        gradient_path=path,
        extensions=extensions,
        recompute=config.model.recompute,
    )
    return executor, schedule


def build_step_end(
    config: RunConfig,
    topology: Topology,
    process: tuple[int, int],
    comm: Comm,
    device: torch.device,
    stages: dict[tuple[int, int], StageRuntime],
    model,
    members: dict,
    scaler: LossScaler | None,
    extensions: Extensions,
) -> StepEnd:
    """The end of step of rank `process[0]` (tensor-parallel shard `process[1]`): its gradient buffers
    and the run's gradient path (`gradient_reduction`), the optimizer and what applies it, the loss
    report; the optimizer step runs `extensions`' hooks."""
    rank, shard = process
    path = config.gradient_path
    modules = {key: stage.module for key, stage in stages.items()}
    bucket_bytes = int(config.run.bucket_mb * 2**20)
    ownership = Ownership(topology, rank, modules, path.sharded)
    sharded: dict[int, nn.Module] = {
        key[1]: module for key, module in modules.items() if isinstance(module, FSDPModule)
    }
    buffers = {
        key: GradientBuffer(module, bucket_bytes, ownership.owners[key] if path.sharded else None)
        for key, module in modules.items()
        if key[1] not in sharded
    }
    grad_scale = (lambda: scaler.scale) if scaler is not None else (lambda: None)
    reduction = (
        FsdpReduction(sharded, keep_gathered=config.optimizer.zero == 2, pipes=topology.schedule.num_pipes)
        if sharded
        else gradient_reduction(
            path,
            topology,
            buffers,
            config.comm.powersgd_rank,
            config.comm.powersgd_start_step,
            config.run.seed,
            grad_scale,
        )
    )
    if sharded and has_tied_weights(model, topology.schedule):
        raise ConfigError(
            f"optimizer.zero: {config.optimizer.zero} with weights tied across stages comes later; "
            "use optimizer.zero 1 or pipeline.stages 1"
        )
    tied = (
        TiedGradients(topology, ownership, modules, model.tied_parameters(), members.get(("tied",), ()))
        if has_tied_weights(model, topology.schedule)
        else None
    )
    optimizer = build_optimizer(config, modules.values(), ownership.updates, method_skip(config, model))
    clip = config.optimizer.clip_norm
    applies = OptimizerStep(
        optimizer,
        build_scheduler(config, optimizer),
        scaler,
        clip,
        (
            ShardedNorm(reduction, shard)
            if isinstance(reduction, FsdpReduction)
            else GlobalNorm(topology, ownership, modules, model.tied_parameters(), shard)
        )
        if clip > 0
        else None,
        extensions.before_optimizer_step,
    )
    return StepEnd(
        comm,
        device,
        Gradients(stages, buffers, ownership, reduction, tied),
        applies,
        LossReport(model.loss_parts, shard == 0),
    )


def device_mesh(topology: Topology, device: torch.device) -> DeviceMesh:
    """The device mesh (data, pipeline, tensor) of the run's processes (`Topology`'s layout).
    Collective: every process creates it."""
    shape = (topology.data_parallel, topology.pipeline_ranks, topology.tensor_parallel)
    return DeviceMesh(
        device.type, torch.arange(topology.processes).reshape(shape), mesh_dim_names=("data", "pipeline", "tensor")
    )


def method_skip(config: RunConfig, model) -> tuple[str, ...] | None:
    """The globs of what the run's curvature method leaves first-order in `model` (None: a first-order run)."""
    return method_of(config).runtime_parts().skip(model) if config.curvature is not None else None


def has_tied_weights(model, schedule: Schedule) -> bool:
    """Whether the model's tied weights live on more than one stage (their gradients are summed)."""
    return bool(model.tied_parameters()) and schedule.num_stages > 1


def train_pipelined(
    config: RunConfig,
    process: int,
    device: torch.device,
    on_step: StepCallback | None = None,
    executor: Executor | None = None,
    resume_from: int | None = None,
    run: RunParts | None = None,
) -> TrainResult:
    """Train on this process (with `executor` if given, else a fresh one from `build_executor`) up
    to `config.run.steps`, continuing from the checkpoint of step `resume_from` when given.
    Checkpoints go to `config.checkpoint.dir` every `checkpoint.every` steps, at the end, and when
    a signal stops the run: then every rank raises `Stopped` after the same step. With
    `run.time_budget_s` every rank ends the run after the same step, the first during which one
    was past the budget (`train_s`), evaluated and checkpointed as the last. `run.trace`:
    a profiler trace of the steps it names (`pipefisher.runtime.training.tracing`). `run`: the
    run's parts, if the caller built them (`build_run`) for `executor`."""
    run = run if run is not None else build_run(config)
    if executor is None:
        executor, _ = build_executor(config, process, device, run)
    rank = executor.rank
    executor.steps = config.run.steps  # each step prepares the next one's micro-batches
    start, reader, how = 0, None, None
    if resume_from is not None:
        start = resume_from
        reader = StateReader(config.checkpoint.dir, start, tied_aliases(run.model))
        how = resumption(config.checkpoint.dir, start, config)
        restore_executor(executor, reader, config, process, how.same_processes)
    if config.curvature is not None:
        from pipefisher.runtime.training.pipefisher_run import PipeFisherTrainer

        # another layout's profile times other stages: this run measures (or reads) its own
        same_layout = reader is not None and how is not None and how.same_layout
        profile = profile_from_dict(reader.required("run/profile")) if reader is not None and same_layout else None
        if reader is not None and same_layout and not reader.get("run/helpers", True):
            config = config.with_overrides(**{method_of(config).name: {"helpers": False}})  # dropped on measured times
        trainer = PipeFisherTrainer(config, executor, rank, executor.tied, profile, model=run.model)
        if reader is not None:
            restore_curvature(trainer, reader, process, same_layout)
        runner: PlanRunner = trainer
    else:
        runner = PlanRunner(executor, rank, schedule_plan(executor.topology.schedule), executor.tied)
    if reader is not None:
        runner.resume()
    losses = []
    every = config.checkpoint.every
    tracer = StepTracer(config, process, device)
    evaluation = pipeline_evaluation(config, executor)
    clock = TrainingClock()
    try:
        for step in range(start, config.run.steps):
            stop_request.deadline = clock.deadline(config.run.time_budget_s)
            tracer.before(step)
            result = runner.run_step(step)
            tracer.after(step)
            result = clock.stamped(result)
            out_of_time = bool(result.extra.get("out_of_time"))
            if evaluation is not None:
                with clock.paused():
                    result = evaluation.after_step(result, last=out_of_time)
            losses.append(result.loss)
            if on_step is not None:
                on_step(result)
            done = step + 1
            signum = result.extra.get("stop_signal")
            ends = done == config.run.steps or out_of_time
            if config.checkpoint.dir and ((every and done % every == 0) or ends or signum):
                save_checkpoint(config, process, executor, runner, done)
            if signum:
                raise Stopped(done, signum, config.checkpoint.dir or None)
            if out_of_time:
                break
    finally:
        stop_request.deadline = None
    parameters = {}
    tensor_group = executor.comm.groups.get(TENSOR)
    for (pipe, stage), runtime in executor.stages.items():
        prefix = f"p{pipe}.{stage}" if pipe else f"{stage}"
        named = (
            runtime.module.named_parameters()
            if tensor_group is None
            else gather_parameters(runtime.module, tensor_group)
        )
        for name, parameter in named:
            parameters[f"{prefix}.{name}"] = full(parameter.detach()).cpu().clone()
    return TrainResult(losses, parameters, gather_state_bytes(executor, runner))


def gather_state_bytes(executor: Executor, runner: PlanRunner) -> tuple[dict[str, int], ...]:
    """Every rank's optimizer-state and curvature-state bytes, on every rank. Collective."""
    runner.quiesce()
    compression = executor.step_end.reduction.tensors()
    mine = {
        "optimizer": tensor_bytes(localized(list(executor.optimizer.state.values()))),
        "curvature": tensor_bytes(runner.state_dict()),
        "compression": tensor_bytes(compression),
    }
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return tuple(everyone)


def save_checkpoint(config: RunConfig, process: int, executor: Executor, runner: PlanRunner, step: int) -> None:
    """Every process saves the entries of `step` it is the lowest holder of (and its own
    layout-tied state); process 0 commits the step once all have. Collective."""
    runner.quiesce()
    mine = entries_to_write(executor, runner, process_state(executor, runner, process))
    record = save_rank(config.checkpoint.dir, step, process, mine)
    records: list = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    if process == 0:
        cycle = (runner.cycle_step, runner.plan.refresh_steps) if config.curvature is not None else None
        for line in commit(
            config.checkpoint.dir, step, manifest_fields(config, cycle, step), records, config.checkpoint.keep
        ):
            logger.info("checkpoint %s", line)
    dist.barrier()
