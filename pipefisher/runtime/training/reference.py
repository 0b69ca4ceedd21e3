"""The single-process reference: the same training as the pipeline, without pipelining.

It sees the same model (parameters depend on the seed and their names, not on the split), the
same micro-batches in the same order, the same loss scaling (mean over all micro-batches of the
step), tied-weight gradients summed, the same precision (autocast, activations rounded to the
compute dtype between stages, fp16's loss scale and overflow skips), the same clipping and
learning-rate schedule, and the same refresh cycle of the curvature method, so its losses and parameters agree with the
pipelined run's to float tolerance.

A model that offers its unsplit form (`unsplit`, `unsplit_loss`, `stage_ends`: Hugging Face
models) is trained as that one object, the independent check of the split; others as their
stages in sequence. It always runs eager, `run.compile` or not: it is the check of compiled stages too.
Under tensor parallelism every split layer holds its shards side by side, and the parameters are
reported joined, under the unsplit model's names.
"""

from __future__ import annotations

import operator
import time
from functools import reduce
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from pipefisher.config import RunConfig
from pipefisher.methods.registry import method_of
from pipefisher.models.tensor_parallel import emulate_shards, unsharded_parameters
from pipefisher.runtime.training.optimizer import build_optimizer, build_scheduler
from pipefisher.runtime.gradient_path.precision import LossScaler, Precision
from pipefisher.runtime.pipeline.executor import StepResult
from pipefisher.runtime.training.assembly import build_run, held_out_batches
from pipefisher.runtime.training.evaluation import TrainingClock, eval_fields
from pipefisher.runtime.training.method_context import method_inputs
from pipefisher.runtime.signals import stop_request
from pipefisher.runtime.training.stopping import Stopped
from pipefisher.runtime.training.trainer import StepCallback, TrainResult, method_skip
from pipefisher.runtime.primitives.grads import grad_of


@dataclass(frozen=True)
class Evaluation:
    """Evaluation during `train_reference`: before step 1, after every `every` steps and after the
    last, the loss and its parts averaged over `batches` (eval mode, no gradients; each batch's
    loss as a micro-batch's, unscaled) go to `report(steps done, {"loss": .., part: ..})`."""

    every: int
    batches: list[dict]
    report: Callable[[int, dict[str, float]], None]

    def due(self, done: int, steps: int) -> bool:
        return done % self.every == 0 or done == steps


def train_reference(
    config: RunConfig, on_step: StepCallback | None = None, evaluation: Evaluation | None = None
) -> TrainResult:
    """The same training in one process: the unsplit model where the model offers it, else all
    stages in sequence with tied copies' gradients summed; micro-batches in id order, the same
    precision, clipping, schedule and curvature method's cycle. Parameters are named as the model names them
    unsplit, or "<stage>.<name>" for stages in sequence. Raises `Stopped` after a step during which this process got SIGTERM or SIGINT (when its
    entry point installed `stop_request`); ends after the step that spent `run.time_budget_s`."""
    run = build_run(config)
    model = run.model
    device = torch.device("cpu")
    precision = Precision(config.run.precision, device)
    net = (_unsplit if hasattr(model, "unsplit") else _stages_in_sequence)(model, config, precision)
    stages = net.modules
    optimizer = build_optimizer(config, stages, skip=method_skip(config, model))
    scheduler = build_scheduler(config, optimizer)
    micro_batch = run.data_source
    scaler = LossScaler(config.run.loss_scale, device) if precision.name == "fp16" else None
    total = config.pipeline.micro_batches * config.pipeline.data_parallel
    tied = net.tied
    curvature = (
        method_of(config).runtime_parts().reference(method_inputs(config), model, nn.ModuleList(stages))
        if config.curvature
        else None
    )
    losses = []
    if evaluation is not None:
        evaluation.report(0, _evaluate(net, evaluation.batches))
    elif config.run.eval_every:  # the run file's evaluation: `eval_loss` in the step records only
        evaluation = Evaluation(config.run.eval_every, held_out_batches(config, config.run.eval_batches), _ignore)
    clock = TrainingClock()
    for step in range(config.run.steps):
        start = time.perf_counter()
        step_loss = 0.0
        extra = {"lr": optimizer.param_groups[0]["lr"], **dict.fromkeys(model.loss_parts, 0.0)}
        for index in range(total):
            batch = micro_batch(step, index)
            loss_scale = None if scaler is None else scaler.scale.clone()
            with curvature.capture(step, index, loss_scale) if curvature else nullcontext():
                loss, parts = net.loss(batch)
                loss = loss * (1.0 / total)  # the scaling the last stage applies
                (loss if scaler is None else loss * scaler.scale).backward()
            step_loss += float(loss.detach())
            for name, value in parts.items():
                extra[name] += float(value) / total
        if curvature:
            curvature.after_step_backwards(step)
        if len(tied) > 1:
            combined = reduce(operator.add, [grad_of(p) for p in tied])  # in order, as the pipeline sums
            for parameter in tied:
                parameter.grad = combined.clone()
        duplicates = {id(p) for p in tied[1:]}
        unique = [p for stage in stages for p in stage.parameters() if id(p) not in duplicates and p.grad is not None]
        overflow = False
        if scaler is not None:
            found = scaler.unscale_([grad_of(p) for p in unique])
            for parameter in tied[1:]:
                parameter.grad = grad_of(tied[0]).clone()
            overflow = bool(found.item() > 0)
            extra["overflow"] = overflow
        if config.optimizer.clip_norm > 0:
            extra["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(unique, config.optimizer.clip_norm))
            for parameter in tied[1:]:
                parameter.grad = grad_of(tied[0]).clone()
        if not overflow:
            if curvature:
                curvature.before_optimizer_update(step)
            optimizer.step()
        if scaler is not None:
            scaler.update(found)
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if curvature:
            curvature.after_optimizer_step(step)
        losses.append(step_loss)
        seconds = time.perf_counter() - start
        result = clock.stamped(StepResult(step + 1, step_loss, seconds, extra))
        out_of_time = clock.spent(config.run.time_budget_s)
        if out_of_time:
            result = replace(result, extra={**result.extra, "out_of_time": True})
        if evaluation is not None and (out_of_time or evaluation.due(step + 1, config.run.steps)):
            with clock.paused():
                evaluated = _evaluate(net, evaluation.batches)
                evaluation.report(step + 1, evaluated)
            if config.run.eval_every:  # as a pipelined run reports it
                result = replace(result, extra={**result.extra, **eval_fields(evaluated)})
        if on_step is not None:
            on_step(result)
        if stop_request.signum:
            raise Stopped(step + 1, stop_request.signum)
        if out_of_time:
            break
    return TrainResult(losses, {name: parameter.detach().clone() for name, parameter in net.named_parameters()})


def _ignore(done: int, metrics: dict[str, float]) -> None:
    """An `Evaluation.report` for evaluations that only go into the step records."""


def _evaluate(net: _Net, batches: list[dict]) -> dict[str, float]:
    """Mean loss and loss parts of `net` over `batches`, in eval mode without gradients (the
    modules' training flags restored after)."""
    modes = [(module, module.training) for stage in net.modules for module in stage.modules()]
    totals: dict[str, float] = {}
    try:
        for stage in net.modules:
            stage.eval()
        with torch.no_grad():
            for batch in batches:
                loss, parts = net.loss(batch)
                for name, value in {"loss": loss, **parts}.items():
                    totals[name] = totals.get(name, 0.0) + float(value) / len(batches)
    finally:
        for module, training in modes:
            module.training = training
    return totals


@dataclass
class _Net:
    """What the reference trains: `modules` (for the optimizer and the curvature method), `loss(batch)` ->
    (loss, parts) under the run's precision, the distinct copies of a tied weight, and the
    parameters to report by name."""

    modules: list[nn.Module]
    loss: Callable[[dict], tuple[Tensor, dict[str, Tensor]]]
    tied: list[nn.Parameter]
    named_parameters: Callable[[], list[tuple[str, Tensor]]]


def _stages_in_sequence(model, config: RunConfig, precision: Precision) -> _Net:
    """The stages in sequence under the run's autocast, each stage's output rounded to the
    compute dtype as the pipeline sends it; then the loss and its parts. Parameters are named
    "<stage>.<name>" as the pipelined run names them."""
    stages = [
        _with_shards(model.build_stage(index, config.model_chunks, config.run.seed), model, config)
        for index in range(config.model_chunks)
    ]

    def loss(batch: dict) -> tuple:
        x = None
        for index, stage in enumerate(stages):
            with precision.autocast():
                x = stage(x, batch)
            if index < len(stages) - 1:
                x = x.to(precision.compute_dtype)
        with precision.autocast():
            return model.loss(x, batch)

    return _Net(
        stages,
        loss,
        _local_tied_copies(stages, model.tied_parameters()),
        lambda: [(f"{i}.{name}", p) for i, stage in enumerate(stages) for name, p in unsharded_parameters(stage)],
    )


def _unsplit(model, config: RunConfig, precision: Precision) -> _Net:
    """The unsplit model object under the run's autocast, its own loss; the output of the last
    block of every stage but the last is rounded to the compute dtype, as the pipeline sends it.
    Parameters keep the model's own names."""
    unsplit = _with_shards(model.unsplit(config.run.seed), model, config)
    for name in model.stage_ends(config.model_chunks):
        unsplit.get_submodule(name).register_forward_hook(
            lambda module, inputs, output: output.to(precision.compute_dtype)
        )

    def loss(batch: dict) -> tuple:
        with precision.autocast():
            return model.unsplit_loss(unsplit, batch)

    return _Net([unsplit], loss, [], lambda: list(unsharded_parameters(unsplit)))


def _with_shards(module: nn.Module, model, config: RunConfig) -> nn.Module:
    """`module` with each layer a tensor-parallel run splits held as its shards side by side
    (`pipefisher.models.tensor_parallel.emulate_shards`), so a curvature method sees the blocks the
    processes see; `module` itself without tensor parallelism."""
    degree = config.pipeline.tensor_parallel
    return emulate_shards(module, model.tensor_parallel_plan(degree), degree) if degree > 1 else module


def _local_tied_copies(stages: list[nn.Module], tied: list[tuple[str, str]]) -> list[nn.Parameter]:
    """The distinct Parameters that are copies of one tied weight, first stage's first."""
    where = {"first": 0, "last": len(stages) - 1}
    copies: list[nn.Parameter] = []
    for selector, name in tied:
        parameter = dict(stages[where[selector]].named_parameters()).get(name)
        if parameter is not None and not any(parameter is p for p in copies):
            copies.append(parameter)
    return copies
