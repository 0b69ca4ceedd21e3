"""Training runs: the run's parts, trainer, reference, profiler, checkpoints, export, launcher and
signals.

The names below are the runtime's public API: what an experiment (`experiments/`) or any program
that drives training itself imports, from this package, never from the modules behind it. A
script runs its `main` under `pipefisher.cli.scripts.entry_point` (one line and 128 + signal on
SIGINT or SIGTERM); the commands' own drivers are `pipefisher.cli.training.run` and `profile_run`.

The run's parts
    `build_run(config) -> RunParts`: the schedule, staged model, text data and data source of a
    run, each built once when first read and passed on (`RunParts.schedule`, `.model`,
    `.data_source`, `.text_data`); `held_out_batches(config, n)`, `tokens_per_step(config)`.
Training
    `train_pipelined(config, process, device, on_step, executor, resume_from, run)` on one process
    of a group, `build_executor(config, process, device, run)` for a caller that drives the
    executor itself (`PlanRunner(executor, rank, schedule_plan(schedule), tied)` steps it
    first-order, `PipeFisherTrainer` with the run's curvature method; `ExecutorExtension` hooks
    into its steps); `train_reference(config, on_step, evaluation=Evaluation(...))` in one
    process; `TrainResult`; `Stopped` when a signal stopped a run; `build_optimizer(config,
    modules, ...)` and `build_scheduler(config, optimizer)`: the run's optimizer and schedule;
    `method_inputs(config)`: what the run's method's runtime, timer and reference are built from;
    `Executor` (what `build_executor` returns) and `Precision` (a run's autocast and casts).
Processes
    `run_group(fn, world, args)` runs `fn(rank, world, *args)` on local processes (`GroupFailure`,
    `Interrupted`); `world_of_one()` makes this process a group of one; `Terminated`: SIGTERM
    raised in a script (`pipefisher.cli.scripts.entry_point`).
Measuring
    `measure_profile` (a profile of the executor's ops and the method's tasks), `pack_options`
    (the packer's options of a run), `compile_blocks` (`run.compile` on a stage), `local_bytes` (a sharded tensor's local bytes), `unique_parameters`
    (a module's parameters, tied ones once), and the memory check: `predict_memory(config)`,
    `measure_memory(rank, world, config, steps)` (a `run_group` worker), `measured_steps(config)`,
    and its probe `LiveTensorBytes` (the peak bytes of live tensors while it is on).

The names are imported when first used, so importing this package (or `stopping`, which the
CLI's entry point does first) loads no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipefisher.runtime.gradient_path.buffers import unique_parameters
    from pipefisher.runtime.gradient_path.sharded import local_bytes
    from pipefisher.runtime.gradient_path.precision import Precision
    from pipefisher.runtime.pipeline.compiled import compile_blocks
    from pipefisher.runtime.pipeline.executor import Executor
    from pipefisher.runtime.pipeline.extension import ExecutorExtension
    from pipefisher.runtime.pipeline.plan_runner import PlanRunner, schedule_plan
    from pipefisher.runtime.primitives.tf32 import set_tf32
    from pipefisher.runtime.training.assembly import RunParts, build_run, held_out_batches, tokens_per_step
    from pipefisher.runtime.training.launch import GroupFailure, Interrupted, run_group, world_of_one
    from pipefisher.runtime.training.memory_check import measure as measure_memory
    from pipefisher.runtime.training.memory_check import measured_steps
    from pipefisher.runtime.training.memory_probe import LiveTensorBytes
    from pipefisher.runtime.training.optimizer import build_optimizer, build_scheduler
    from pipefisher.runtime.training.method_context import method_inputs
    from pipefisher.runtime.training.memory_check import predict as predict_memory
    from pipefisher.runtime.training.pipefisher_run import PipeFisherTrainer, pack_options
    from pipefisher.runtime.training.profiler import measure_profile
    from pipefisher.runtime.training.reference import Evaluation, train_reference
    from pipefisher.runtime.training.stopping import Stopped, Terminated
    from pipefisher.runtime.training.trainer import TrainResult, build_executor, train_pipelined

#: public name -> (module, its name there)
_EXPORTS: dict[str, tuple[str, str]] = {
    "RunParts": ("pipefisher.runtime.training.assembly", "RunParts"),
    "build_run": ("pipefisher.runtime.training.assembly", "build_run"),
    "held_out_batches": ("pipefisher.runtime.training.assembly", "held_out_batches"),
    "tokens_per_step": ("pipefisher.runtime.training.assembly", "tokens_per_step"),
    "train_pipelined": ("pipefisher.runtime.training.trainer", "train_pipelined"),
    "build_optimizer": ("pipefisher.runtime.training.optimizer", "build_optimizer"),
    "build_scheduler": ("pipefisher.runtime.training.optimizer", "build_scheduler"),
    "method_inputs": ("pipefisher.runtime.training.method_context", "method_inputs"),
    "build_executor": ("pipefisher.runtime.training.trainer", "build_executor"),
    "Executor": ("pipefisher.runtime.pipeline.executor", "Executor"),
    "Precision": ("pipefisher.runtime.gradient_path.precision", "Precision"),
    "TrainResult": ("pipefisher.runtime.training.trainer", "TrainResult"),
    "PlanRunner": ("pipefisher.runtime.pipeline.plan_runner", "PlanRunner"),
    "schedule_plan": ("pipefisher.runtime.pipeline.plan_runner", "schedule_plan"),
    "PipeFisherTrainer": ("pipefisher.runtime.training.pipefisher_run", "PipeFisherTrainer"),
    "pack_options": ("pipefisher.runtime.training.pipefisher_run", "pack_options"),
    "ExecutorExtension": ("pipefisher.runtime.pipeline.extension", "ExecutorExtension"),
    "train_reference": ("pipefisher.runtime.training.reference", "train_reference"),
    "Evaluation": ("pipefisher.runtime.training.reference", "Evaluation"),
    "Stopped": ("pipefisher.runtime.training.stopping", "Stopped"),
    "run_group": ("pipefisher.runtime.training.launch", "run_group"),
    "world_of_one": ("pipefisher.runtime.training.launch", "world_of_one"),
    "GroupFailure": ("pipefisher.runtime.training.launch", "GroupFailure"),
    "Interrupted": ("pipefisher.runtime.training.launch", "Interrupted"),
    "Terminated": ("pipefisher.runtime.training.stopping", "Terminated"),
    "measure_profile": ("pipefisher.runtime.training.profiler", "measure_profile"),
    "compile_blocks": ("pipefisher.runtime.pipeline.compiled", "compile_blocks"),
    "unique_parameters": ("pipefisher.runtime.gradient_path.buffers", "unique_parameters"),
    "local_bytes": ("pipefisher.runtime.gradient_path.sharded", "local_bytes"),
    "predict_memory": ("pipefisher.runtime.training.memory_check", "predict"),
    "measure_memory": ("pipefisher.runtime.training.memory_check", "measure"),
    "measured_steps": ("pipefisher.runtime.training.memory_check", "measured_steps"),
    "LiveTensorBytes": ("pipefisher.runtime.training.memory_probe", "LiveTensorBytes"),
    "set_tf32": ("pipefisher.runtime.primitives.tf32", "set_tf32"),
}

__all__ = [
    "Evaluation",
    "Executor",
    "ExecutorExtension",
    "GroupFailure",
    "Interrupted",
    "LiveTensorBytes",
    "PipeFisherTrainer",
    "PlanRunner",
    "Precision",
    "RunParts",
    "Stopped",
    "Terminated",
    "TrainResult",
    "build_executor",
    "build_optimizer",
    "build_run",
    "build_scheduler",
    "compile_blocks",
    "held_out_batches",
    "local_bytes",
    "measure_memory",
    "measure_profile",
    "measured_steps",
    "method_inputs",
    "pack_options",
    "predict_memory",
    "run_group",
    "schedule_plan",
    "set_tf32",
    "tokens_per_step",
    "train_pipelined",
    "train_reference",
    "unique_parameters",
    "world_of_one",
]


def __getattr__(name: str) -> Any:
    """A public name, imported on first use (PEP 562)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _EXPORTS[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
