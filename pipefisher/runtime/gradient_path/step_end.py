"""The collective end of a step, after a rank's last op: gradients reduced over each stage's
replicas (launched as soon as the stage's gradient is final), tied weights summed, then one
all-reduce over all ranks of [loss, loss parts, squared gradient norm, fp16 overflow flag, stop
signal (`pipefisher.runtime.training.stopping`)]; when it completes, clipping, `before_optimizer_step`
(Shampoo's preconditioning) and the optimizer step (both skipped on every rank alike when fp16
overflowed) and the learning-rate schedule; with ZeRO-1 the owners then broadcast the updated
parameters. `finish` reads the reduced numbers once: the step's only host synchronisation.

ZeRO-1 (the gradient buffers have owners): a stage's gradient is reduced to the owner of each
bucket instead of to every holder, and each rank's optimizer holds only what it owns. PowerSGD
(`powersgd`, from step `powersgd_start` on): the reduction is the two all-reduces of
`pipefisher.runtime.gradient_path.powersgd`, ``grad`` and ``grad_q``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from pipefisher.planning.comm.actions import STEP, TIED, Collective, gather_collective, grad_collective, grad_q_collective
from pipefisher.runtime.gradient_path.buffers import GlobalNorm, GradientBuffer, Ownership, TiedGradients, clip_coefficient
from pipefisher.runtime.gradient_path.powersgd import PowerSGD
from pipefisher.runtime.gradient_path.precision import LossScaler
from pipefisher.runtime.pipeline.comm import Comm, Handle, done
from pipefisher.runtime.pipeline.stage import StageRuntime
from pipefisher.runtime.training.stopping import stop_request


class StepEnd:
    """Providers of the end-of-step collectives (`grad`, `tied`, `step`, ZeRO-1's `gather`) and
    `finish()`.

    `update` False (profiling) drops the gradients instead of applying them: no reduction, no
    optimizer step; the loss is still summed. `reports_loss` False: this process's losses are
    left out of the sum (a tensor-parallel shard other than 0). `ownership` says which parameters this rank updates
    (all of them without ZeRO).
    """

    def __init__(
        self,
        comm: Comm,
        device: torch.device,
        stages: dict[tuple[int, int], StageRuntime],
        buffers: dict[tuple[int, int], GradientBuffer],
        optimizer: torch.optim.Optimizer,
        loss_parts: tuple[str, ...] = (),
        tied: TiedGradients | None = None,
        norm: GlobalNorm | None = None,
        clip_norm: float = 0.0,
        scaler: LossScaler | None = None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        ownership: Ownership | None = None,
        powersgd: dict[tuple[int, int], PowerSGD] | None = None,
        powersgd_start: int = 0,
        reports_loss: bool = True,
    ):
        self.comm, self.device, self.ownership = comm, device, ownership
        self.powersgd, self.powersgd_start = powersgd or {}, powersgd_start
        #: whether this process's losses count in the world reduction (one of a rank's
        #: tensor-parallel processes, which compute the same loss, reports it)
        self.reports_loss = reports_loss
        #: the step being run (0-based; the executor sets it)
        self.step = 0
        self.stages, self.buffers, self.optimizer = stages, buffers, optimizer
        self.loss_parts, self.tied, self.norm, self.clip_norm = loss_parts, tied, norm, clip_norm
        self.scaler, self.scheduler = scaler, scheduler
        self.update = True
        #: runs on the reduced, clipped gradients right before every optimizer step
        self.before_optimizer_step: Callable[[], None] = lambda: None
        self._reduced: Tensor | None = None
        self._values: list[float] | None = None
        self._lr = 0.0

    def applies_to(self, parameter: torch.nn.Parameter) -> bool:
        """Whether this rank updates `parameter` (with ZeRO-1, only its owner does)."""
        return self.ownership is None or self.ownership.updates(parameter)

    def gradients(self) -> list[Tensor]:
        """The gradients this rank applies."""
        return [gradient for buffer in self.buffers.values() for parameter, gradient in zip(buffer.parameters, buffer.gradients)
                if self.applies_to(parameter)]

    def _stage_buffers(self, stage: int) -> list[GradientBuffer]:
        return [buffer for (pipe, s), buffer in self.buffers.items() if s == stage]

    def _compressors(self, stage: int) -> list[PowerSGD]:
        """The stage's PowerSGD states when this step compresses, else []."""
        if not self.update or self.step < self.powersgd_start:
            return []
        return [compressor for (pipe, s), compressor in self.powersgd.items() if s == stage]


    # -- collectives ------------------------------------------------------------------------
    def launch_grad(self, collective: Collective) -> Handle:
        """Sum the gradient of stage `collective.key[0]` over its replicas, bucket by bucket."""
        if not self.update:
            return done()
        buffers = self._stage_buffers(collective.key[0])
        compressors = self._compressors(collective.key[0])
        if compressors:
            factors = [tensor for compressor in compressors for tensor in compressor.p_factors()]
            return self.comm.all_reduce(factors, collective.group)
        buckets = [bucket for buffer in buffers for bucket in buffer.buckets]
        if buffers and buffers[0].owners is not None:
            return self.comm.reduce([(b, owner) for buffer in buffers for b, owner in zip(buffer.buckets, buffer.bucket_owners)],
                                    collective.group)
        return self.comm.all_reduce(buckets, collective.group)

    def launch_grad_q(self, collective: Collective) -> Handle:
        """PowerSGD's second all-reduce (its ``grad`` all-reduce is in): the Q factors of stage
        `collective.key[0]`, then the gradient decompressed. Nothing before its start step."""
        compressors = self._compressors(collective.key[0])
        if not compressors:
            return done()
        factors = [tensor for compressor in compressors for tensor in compressor.q_factors()]
        return self.comm.all_reduce(factors, collective.group, on_done=lambda: [c.decompress() for c in compressors])

    def reduce_now(self, stage: int) -> None:
        """Stage `stage`'s whole gradient path at once, outside a plan's actions (the profiler
        times it): the reduction (PowerSGD's two all-reduces as from its start step on; the caller
        keeps and restores its state) and ZeRO-1's broadcasts. Collective over the stage's replicas."""
        step, self.step = self.step, max(self.step, self.powersgd_start)
        try:
            self.launch_grad(grad_collective(stage)).wait()
            self.launch_grad_q(grad_q_collective(stage)).wait()
            if self.ownership is not None and self.ownership.sharded:
                self.launch_gather(gather_collective(stage)).wait()
        finally:
            self.step = step

    def launch_gather(self, collective: Collective) -> Handle:
        """ZeRO-1: every owner broadcasts its updated parameters of stage `collective.key[0]`."""
        if not self.update:
            return done()
        buffers = self._stage_buffers(collective.key[0])
        return self.comm.broadcast([(b, owner) for buffer in buffers for b, owner in zip(buffer.parameter_buckets, buffer.bucket_owners)],
                                   collective.group)

    def launch_tied(self, collective: Collective) -> Handle:
        if not self.update or self.tied is None:
            return done()
        return self.tied.launch(self.comm)

    def launch_step(self, collective: Collective) -> Handle:
        """The world reduction of [loss, parts..., squared norm, overflow] (float64, on the device)."""
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
                values.append(self.norm.local_square(self.device))
            if overflow is not None:
                values.append(overflow.double().reshape(()))
        signum = stop_request.signum  # a host value: the sum tells every rank that one was signalled
        values += [torch.full((), float(signum), dtype=torch.float64, device=self.device),
                   torch.full((), float(signum > 0), dtype=torch.float64, device=self.device)]
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
        reduced = self._reduced
        count = 1 + len(self.loss_parts)
        self._lr = self.optimizer.param_groups[0]["lr"]
        if self.clip_norm > 0:
            coefficient = clip_coefficient(reduced[count], self.clip_norm)
            for buffer in self.buffers.values():
                buffer.flat.mul_(coefficient)
        if self.scaler is not None:
            self._values = reduced.tolist()
            if not self._values[-3] > 0:
                self.before_optimizer_step()
                self.optimizer.step()
            self.scaler.update(reduced[-3])
        else:
            self.before_optimizer_step()
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()

    def finish(self) -> dict:
        """After the world reduction (and the update it triggered): zero the gradients; returns the
        loss, its parts, (when updating) lr, grad_norm, fp16's overflow and grad_comm_bytes, and
        `stop_signal` when a rank was signalled, read from the device once. grad_comm_bytes: what
        this rank sent on the gradient communicators in the step (reductions, ZeRO-1's
        broadcasts, PowerSGD's factors, K-FAC gradient workers' broadcasts)."""
        reduced, self._reduced = self._reduced, None
        values, self._values = self._values if self._values is not None else reduced.tolist(), None
        record: dict = {}
        count = 1 + len(self.loss_parts)
        if self.update:
            record["lr"] = self._lr
            if self.scaler is not None:
                record["overflow"] = values[-3] > 0
            if self.clip_norm > 0:
                record["grad_norm"] = math.sqrt(values[count])
            record["grad_comm_bytes"] = self.comm.sent_bytes["grad"] + self.comm.sent_bytes["pgrad"]
        self.comm.sent_bytes.clear()
        for buffer in self.buffers.values():
            buffer.zero_()
        record["loss"] = values[0]
        record.update(zip(self.loss_parts, values[1:count]))
        signals, signalled = values[-2:]
        if signalled:
            record["stop_signal"] = round(signals / signalled)
        return record
