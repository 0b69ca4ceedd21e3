"""The collective end of a step, after a rank's last op: gradients reduced over each stage's
replicas (launched as soon as the stage's gradient is final) by the run's gradient path
(`pipefisher.runtime.gradient_path.reduction`: all-reduce, ZeRO-1 or PowerSGD; ZeRO-2/3's FSDP2
reduce-scatter inside the last backward, `pipefisher.runtime.gradient_path.sharded`), tied weights
summed, then one all-reduce over all ranks of [loss, loss parts, squared gradient norm, fp16
overflow flag, stop signal (`pipefisher.runtime.signals`)]; when it completes, clipping,
`before_optimizer_step` (Shampoo's preconditioning) and the optimizer step (both skipped on every
rank alike when fp16 overflowed) and the learning-rate schedule; with ZeRO-1 the owners then
broadcast the updated parameters. `finish` reads the reduced numbers once: the step's only host
synchronisation.

`StepEnd` receives everything at construction, in three parts: the `Gradients` it reduces, the
`OptimizerStep` it applies and the `LossReport` it sums.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from pipefisher.planning.comm.actions import STEP, TIED, Collective
from pipefisher.runtime.gradient_path.buffers import (
    SquaredNorm,
    GradientBuffer,
    Ownership,
    TiedGradients,
    clip_coefficient,
)
from pipefisher.runtime.gradient_path.precision import LossScaler
from pipefisher.runtime.gradient_path.reduction import AllReduce, GradientReduction
from pipefisher.runtime.gradient_path.sharded import FsdpReduction
from pipefisher.runtime.primitives.comm import Comm, Handle, done
from pipefisher.runtime.pipeline.stage import StageRuntime
from pipefisher.runtime.signals import stop_request

#: the world reduction ends [..., fp16 overflow, signal sum, signalled ranks, out-of-time ranks]
_OVERFLOW = -4


@dataclass(frozen=True)
class Gradients:
    """What a rank's end of step reduces: its `stages` and their gradient `buffers` (by (pipe,
    stage)), `ownership` (which parameters this rank updates: all of them without ZeRO), the
    gradient path's `reduction` (default: an all-reduce of `buffers`) and the `tied` weights'
    sum (None: no weight tied across stages)."""

    stages: dict[tuple[int, int], StageRuntime]
    buffers: dict[tuple[int, int], GradientBuffer]
    ownership: Ownership | None = None
    reduction: GradientReduction | None = None
    tied: TiedGradients | None = None


@dataclass(frozen=True)
class OptimizerStep:
    """What applies the reduced gradients: the `optimizer` and its `scheduler`, fp16's `scaler`,
    clipping to `clip_norm` (0: none) of the `norm` over all ranks, and `before_optimizer_step`,
    run on the reduced, clipped gradients right before every optimizer step (the executor's
    extensions' hook)."""

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    scaler: LossScaler | None = None
    clip_norm: float = 0.0
    norm: SquaredNorm | None = None
    before_optimizer_step: Callable[[], None] = lambda: None


@dataclass(frozen=True)
class LossReport:
    """The loss's named `parts` besides the total; `reports` False: this process's losses are
    left out of the sum (a tensor-parallel shard other than 0, which computes the same loss)."""

    parts: tuple[str, ...] = ()
    reports: bool = True


class StepEnd:
    """Providers of the end-of-step collectives (`grad`, `tied`, `step`, ZeRO-1's `gather`,
    PowerSGD's `grad_q`) and `finish()`.

    `begin(step, update)` before each step: `update` False (profiling) drops the gradients instead
    of applying them: no reduction, no optimizer step; the loss is still summed. Under ZeRO-2/3
    the stage's last backward still reduce-scatters (`launch_grad`) and `finish` drops the shards.
    """

    def __init__(
        self,
        comm: Comm,
        device: torch.device,
        gradients: Gradients,
        optimizer_step: OptimizerStep,
        loss: LossReport = LossReport(),
    ):
        self.comm, self.device = comm, device
        self.stages, self.buffers, self.ownership, self.tied = (
            gradients.stages,
            gradients.buffers,
            gradients.ownership,
            gradients.tied,
        )
        #: the gradient path's strategy
        self.reduction = gradients.reduction if gradients.reduction is not None else AllReduce(gradients.buffers)
        self.optimizer, self.scheduler, self.scaler = (
            optimizer_step.optimizer,
            optimizer_step.scheduler,
            optimizer_step.scaler,
        )
        self.clip_norm, self.norm = optimizer_step.clip_norm, optimizer_step.norm
        self.before_optimizer_step = optimizer_step.before_optimizer_step
        self.loss_parts = loss.parts
        #: whether this process's losses count in the world reduction
        self.reports_loss = loss.reports
        #: the step being run (0-based) and whether it updates (`begin`)
        self.step = 0
        self.update = True
        self._reduced: Tensor | None = None
        self._values: list[float] | None = None
        self._lr = 0.0

    def begin(self, step: int, update: bool = True) -> None:
        """Step `step` (0-based) starts; `update` False: its gradients are dropped."""
        self.step, self.update = step, update

    def applies_to(self, parameter: torch.nn.Parameter) -> bool:
        """Whether this rank updates `parameter` (with ZeRO-1, only its owner does)."""
        return self.ownership is None or self.ownership.updates(parameter)

    def gradients(self) -> list[Tensor]:
        """The gradients this rank applies."""
        return [
            gradient
            for buffer in self.buffers.values()
            for parameter, gradient in zip(buffer.parameters, buffer.gradients)
            if self.applies_to(parameter)
        ]

    # -- collectives ------------------------------------------------------------------------
    def launch_grad(self, collective: Collective) -> Handle:
        """Reduce the gradient of stage `collective.key[0]` over its replicas (the gradient path).
        A step that drops its gradients reduces nothing, except under ZeRO-2/3: FSDP2 accumulates
        a replica's gradient whole until an armed backward reduce-scatters it, so the stage's last
        backward is armed as in an updating step (a profile's backward times include the
        reduce-scatter, and nothing is left accumulated for the next step)."""
        if not self.update and not isinstance(self.reduction, FsdpReduction):
            return done()
        return self.reduction.launch_grad(self.comm, collective, self.step)

    def launch_grad_q(self, collective: Collective) -> Handle:
        """The gradient path's second reduction (PowerSGD's Q factors, then the decompression)."""
        if not self.update:
            return done()
        return self.reduction.launch_grad_q(self.comm, collective, self.step)

    def reduce_now(self, stage: int) -> None:
        """Stage `stage`'s whole gradient path at once, outside a plan's actions (the profiler
        times it; with PowerSGD as from its start step on, the caller keeping and restoring its
        state). Collective over the stage's replicas."""
        if self.update:
            self.reduction.reduce_now(self.comm, stage, self.step)

    def launch_gather(self, collective: Collective) -> Handle:
        """ZeRO-1: every owner broadcasts its updated parameters of stage `collective.key[0]`."""
        if not self.update:
            return done()
        return self.reduction.launch_gather(self.comm, collective)

    def launch_unshard(self, collective: Collective) -> Handle:
        """ZeRO-2/3: FSDP2 issues the all-gathers of `collective` itself, inside the op that
        follows; nothing to launch (the plan names them so that the replay checks their order)."""
        return done()

    def launch_grad_pipes(self, collective: Collective) -> Handle:
        """ZeRO-2/3 with several pipes: stage `collective.key[0]`'s gradient shards summed over
        its copies in every pipe."""
        if not self.update:
            return done()
        return self.reduction.launch_grad_pipes(self.comm, collective)

    def launch_tied(self, collective: Collective) -> Handle:
        if not self.update or self.tied is None:
            return done()
        return self.tied.launch(self.comm)

    def launch_step(self, collective: Collective) -> Handle:
        """The world reduction of [loss, parts..., squared norm, overflow, signal, signalled,
        out of time] (float64, on the device)."""
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        total, parts = zero, dict.fromkeys(self.loss_parts, zero)
        for stage in self.stages.values():
            stage_total, stage_parts = stage.take_loss()
            if not self.reports_loss:
                continue
            if stage_total is not None:
                total = total + stage_total.double()
            for name, value in stage_parts.items():
                parts[name] = parts[name] + value.double()
        values = [total, *parts.values()]
        if self.update:
            overflow = self.scaler.unscale_(self.gradients()) if self.scaler is not None else None
            if self.clip_norm > 0:
                if self.norm is None:
                    raise ValueError("clip_norm > 0 needs the norm it clips (OptimizerStep.norm)")
                values.append(self.norm.local_square(self.device))
            if overflow is not None:
                values.append(overflow.double().reshape(()))
        signum = stop_request.signum  # host values: the sums tell every rank that one was signalled
        values += [  # or out of time, so that all stop after this step
            torch.full((), float(value), dtype=torch.float64, device=self.device)
            for value in (signum, signum > 0, stop_request.out_of_time())
        ]
        self._reduced = torch.stack(values)
        return self.comm.all_reduce([self._reduced], collective.group, on_done=self._apply)

    def apply_now(self) -> dict:
        """The end of a step outside of a plan's actions, with gradients already reduced over
        replicas (profiling): tied sum, world reduction, `finish`. Collective over all ranks."""
        self.launch_tied(TIED).wait()
        self.launch_step(STEP).wait()
        return self.finish()

    # -- after the reduction ----------------------------------------------------------------
    def _apply(self) -> None:
        """Once the world reduction completed: clip, step (unless fp16 overflowed, which needs the
        reduced flag on the host), schedule."""
        if not self.update:
            return
        reduced = self._world_sums()
        count = 1 + len(self.loss_parts)
        self._lr = self.optimizer.param_groups[0]["lr"]
        if self.clip_norm > 0:
            coefficient = clip_coefficient(reduced[count], self.clip_norm)
            for buffer in self.buffers.values():
                buffer.flat.mul_(coefficient)
            self.reduction.scale_(coefficient)
        if self.scaler is not None:
            self._values = reduced.tolist()
            if not self._values[_OVERFLOW] > 0:
                self.before_optimizer_step()
                self.optimizer.step()
            self.scaler.update(reduced[_OVERFLOW])
        else:
            self.before_optimizer_step()
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()

    def _world_sums(self) -> Tensor:
        """The step's world reduction (launched by `launch_step`); RuntimeError before it."""
        if self._reduced is None:
            raise RuntimeError("the step's world reduction has not been launched")
        return self._reduced

    def finish(self) -> dict:
        """After the world reduction (and the update it triggered): zero the gradients; returns the
        loss, its parts, (when updating) lr, grad_norm, fp16's overflow and grad_comm_bytes, and
        `stop_signal` when a rank was signalled and `out_of_time` when one was past the time budget's
        deadline, read from the device once. grad_comm_bytes: what
        this rank sent on the gradient communicators in the step (reductions, ZeRO-1's
        broadcasts, PowerSGD's factors, K-FAC gradient workers' broadcasts, Chimera's sums of
        ZeRO-2/3 shards over the pipes); FSDP2's own all-gathers and reduce-scatters do not go
        through `Comm` and are not in it (their volume is the memory model's traffic);
        help_comm_bytes, where the rank sent on a help communicator (`OpKind.HELP`)."""
        reduced, self._reduced = self._world_sums(), None
        values, self._values = self._values if self._values is not None else reduced.tolist(), None
        record: dict = {}
        count = 1 + len(self.loss_parts)
        if self.update:
            record["lr"] = self._lr
            if self.scaler is not None:
                record["overflow"] = values[_OVERFLOW] > 0
            if self.clip_norm > 0:
                record["grad_norm"] = math.sqrt(values[count])
            record["grad_comm_bytes"] = self.comm.sent_bytes["grad"] + self.comm.sent_bytes["pgrad"]
        if self.comm.sent_bytes["help"]:
            record["help_comm_bytes"] = self.comm.sent_bytes["help"]
        self.comm.sent_bytes.clear()
        for buffer in self.buffers.values():
            buffer.zero_()
        self.reduction.zero_()
        record["loss"] = values[0]
        record.update(zip(self.loss_parts, values[1:count]))
        signals, signalled, out_of_time = values[_OVERFLOW + 1 :]
        if signalled:
            record["stop_signal"] = round(signals / signalled)
        if out_of_time:
            record["out_of_time"] = True
        return record
