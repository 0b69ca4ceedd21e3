"""The executor: one rank walks its op list, step after step, through a dispatch table.

Before running op i it posts the receive op i+1 will need, so transfers overlap compute; each
op waits for its own input right before use. A step ends with the sends drained, gradients summed
over each stage's replicas, the optimizer step, and the step loss summed over all ranks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor

from pipefisher.ir import Op, OpKind
from pipefisher.runtime.errors import first_line
from pipefisher.runtime.comm import Comm, PendingRecv
from pipefisher.runtime.stage import StageRuntime
from pipefisher.runtime.topology import Topology

#: (step, global micro-batch) -> the micro-batch's named tensors
MicroBatchFn = Callable[[int, int], dict[str, Tensor]]
#: stage -> shape of the activation it sends to the next stage
ShapeFn = Callable[[int], tuple[int, ...]]


class StepFailure(RuntimeError):
    """An op failed; the message names the rank, the step and the op."""


@dataclass(frozen=True)
class StepResult:
    """One finished step: 1-based `step`, mean loss, wall time; `extra` fields to log."""

    step: int
    loss: float
    seconds: float
    extra: dict = field(default_factory=dict)


class Executor:
    def __init__(
        self,
        topology: Topology,
        rank: int,
        stages: dict[tuple[int, int], StageRuntime],
        comm: Comm,
        micro_batch: MicroBatchFn,
        output_shape: ShapeFn,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        loss_parts: tuple[str, ...] = (),
    ):
        self.topology, self.rank, self.stages, self.comm = topology, rank, stages, comm
        self.micro_batch, self.output_shape = micro_batch, output_shape
        self.optimizer, self.device = optimizer, device
        self.loss_parts = loss_parts
        #: run in order after the gradients are summed over replicas, before the optimizer step
        self.gradient_hooks: list[Callable[[], None]] = []
        #: global-norm clipping (returns the norm before clipping), or None
        self.clipper: Callable[[], float] | None = None
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self.handlers: dict[OpKind, Callable[[Op], list]] = {
            OpKind.FORWARD: self._forward,
            OpKind.BACKWARD: self._backward,
        }
        #: context the forward of an op runs in (K-FAC uses it to capture activations)
        self.forward_context: Callable[[Op], AbstractContextManager] = lambda op: nullcontext()
        #: called with (op, start, end) in perf_counter seconds for every op (the profiler's hook)
        self.recorder: Callable[[Op, float, float], None] | None = None
        self._receives: dict[tuple[OpKind, int, int, int], PendingRecv] = {}
        self._local: dict[tuple[OpKind, int, int, int], Tensor] = {}
        self._gradient_groups = self._group_parameters()
        self.current_step = 0
        self._ready_at = 0.0

    # -- a step ------------------------------------------------------------------------------
    def run_step(self, step: int, ops: Sequence[Op], update: bool = True) -> StepResult:
        """Run `ops` as step `step` (0-based); with `update=False` gradients are dropped instead
        of applied (profiling steps leave the model as it was)."""
        start = time.perf_counter()
        self.current_step = step
        for index, op in enumerate(ops):
            try:
                if index == 0:
                    self._post_receive(op)
                if index + 1 < len(ops):
                    self._post_receive(ops[index + 1])
                self._ready_at = time.perf_counter()
                sends = self.handlers[op.kind](op)
                self.comm.exchange(sends, [])
                if self.recorder is not None:
                    self.recorder(op, self._ready_at, time.perf_counter())
            except Exception as exc:
                raise StepFailure(f"rank {self.rank} failed at step {step + 1}, op {op}: {first_line(exc)}") from exc
        extra: dict = {}
        try:
            self.comm.finish_sends()
            if update:
                extra.update(self.apply_gradients())
            self.optimizer.zero_grad(set_to_none=True)
            total, parts = 0.0, dict.fromkeys(self.loss_parts, 0.0)
            for stage in self.stages.values():
                stage_total, stage_parts = stage.take_loss()
                total += stage_total
                for name, value in stage_parts.items():
                    parts[name] += value
            loss, *sums = self.comm.sum_over_world([total, *parts.values()])
            extra.update(zip(parts, sums))
        except Exception as exc:
            raise StepFailure(f"rank {self.rank} failed at step {step + 1}, end of step: {first_line(exc)}") from exc
        return StepResult(step=step + 1, loss=loss, seconds=time.perf_counter() - start, extra=extra)

    def apply_gradients(self) -> dict:
        """Collective end of a step: sum gradients over replicas, run the gradient hooks, clip,
        step the optimizer and the schedule; returns the fields to log (lr, grad_norm)."""
        extra: dict = {"lr": self.optimizer.param_groups[0]["lr"]}
        self.comm.all_reduce_gradients(self._gradient_groups)
        for hook in self.gradient_hooks:
            hook()
        if self.clipper is not None:
            extra["grad_norm"] = self.clipper()
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        return extra

    # -- handlers ----------------------------------------------------------------------------
    def _forward(self, op: Op) -> list:
        stage = self.stages[(op.pipe, op.stage)]
        global_mb = self.topology.global_micro_batch(self.rank, op.micro_batch)
        batch = {name: tensor.to(self.device) for name, tensor in self.micro_batch(self.current_step, global_mb).items()}
        inputs = None if stage.first else self._input_of(op)
        with self.forward_context(op):
            output = stage.forward(op.micro_batch, inputs, batch)
        if stage.last:
            return []
        return self._deliver(OpKind.FORWARD, op.pipe, op.stage + 1, op.micro_batch, output, lower_stage=op.stage)

    def _backward(self, op: Op) -> list:
        stage = self.stages[(op.pipe, op.stage)]
        grad_output = None if stage.last else self._input_of(op)
        grad_input = stage.backward(op.micro_batch, grad_output)
        if stage.first:
            return []
        return self._deliver(OpKind.BACKWARD, op.pipe, op.stage - 1, op.micro_batch, grad_input, lower_stage=op.stage - 1)

    # -- transfers ---------------------------------------------------------------------------
    def _source(self, op: Op) -> tuple[int, int] | None:
        """(stage that produces op's input, channel's lower stage), or None if it needs none."""
        last = self.topology.schedule.num_stages - 1
        if op.kind is OpKind.FORWARD and op.stage > 0:
            return op.stage - 1, op.stage - 1
        if op.kind is OpKind.BACKWARD and op.stage < last:
            return op.stage + 1, op.stage
        return None

    def _post_receive(self, op: Op) -> None:
        source = self._source(op)
        key = (op.kind, op.pipe, op.stage, op.micro_batch)
        if source is None or key in self._receives or key in self._local:
            return
        producer, lower = source
        replica = self.topology.replica_of(self.rank)
        peer = self.topology.rank(replica, op.pipe, producer)
        if peer == self.rank:
            return  # handed over locally by the producing op
        shape = self.output_shape(lower)
        (pending,) = self.comm.exchange([], [(shape, peer, self.comm.channel(op.pipe, lower))])
        self._receives[key] = pending

    def _input_of(self, op: Op) -> Tensor:
        key = (op.kind, op.pipe, op.stage, op.micro_batch)
        if key in self._local:
            return self._local.pop(key)
        if key not in self._receives:
            self._post_receive(op)
        tensor = self._receives.pop(key).wait()
        self._ready_at = time.perf_counter()  # the op's compute starts now, not when it began waiting
        return tensor

    def _deliver(self, kind: OpKind, pipe: int, stage: int, micro_batch: int, tensor: Tensor, lower_stage: int) -> list:
        """Hand `tensor` to the op (kind, pipe, stage, micro_batch): locally or as a send."""
        peer = self.topology.rank(self.topology.replica_of(self.rank), pipe, stage)
        if peer == self.rank:
            self._local[(kind, pipe, stage, micro_batch)] = tensor
            return []
        return [(tensor, peer, self.comm.channel(pipe, lower_stage))]

    # -- gradients ---------------------------------------------------------------------------
    def _group_parameters(self) -> dict[tuple[int, ...], list[torch.nn.Parameter]]:
        """Parameters of replicated stages, by the replica group that sums their gradients."""
        groups: dict[tuple[int, ...], list[torch.nn.Parameter]] = {}
        for (pipe, stage), runtime in sorted(self.stages.items(), key=lambda item: (item[0][1], item[0][0])):
            ranks = self.topology.replica_ranks(stage)
            if len(ranks) > 1:
                groups.setdefault(ranks, []).extend(runtime.module.parameters())
        return groups

