"""Held-out evaluation on the pipeline: one rank's forward-only pass over fixed micro-batches.

The pass performs the rank's actions of `pipefisher.planning.comm.evaluation.evaluation_actions`
(the training schedule's forwards, swept in rounds, replayed under NCCL's rule when the pass is
built) on the executor's stages, communicators and precision: each stage in eval mode (dropout
off; the modules' training flags restored after), without gradients, without the executor's
extensions (no curvature capture), without touching the stages' activations or losses of
training. The last stages' losses and their named parts are summed in float64 and all-reduced
over every process (``("world",)``, the plan's last action), so every process returns the same
mean. A pass runs between training steps, when the training step's communication is complete.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from pipefisher.core.op_fields import micro_batch_of
from pipefisher.core.ir import Op
from pipefisher.planning.comm.actions import Action, ActionKind, Message, SendDone, input_message, output_message
from pipefisher.planning.comm.evaluation import evaluation_actions
from pipefisher.runtime.pipeline.batches import DeviceBatch
from pipefisher.runtime.pipeline.executor import Executor
from pipefisher.runtime.primitives.comm import Handle


class EvalPass:
    """Evaluation of `batches` (global micro-batches, split evenly over the data-parallel
    replicas: replica r evaluates r·M .. r·M + M − 1, M = len(batches) / replicas) on
    `executor`'s rank. `run()` is collective over every process of the run."""

    def __init__(self, executor: Executor, batches: Sequence[Mapping[str, Tensor]]):
        replicas = executor.topology.data_parallel
        if not batches or len(batches) % replicas:
            raise ValueError(f"{len(batches)} evaluation micro-batches do not split evenly over {replicas} replicas")
        self.executor, self.batches = executor, batches
        self.plan = evaluation_actions(executor.topology, len(batches) // replicas)
        #: this rank's actions of a pass
        self.actions: tuple[Action, ...] = self.plan.steps[0][executor.rank]

    def run(self) -> dict[str, float]:
        """The mean loss (``"loss"``) and mean named parts over the batches, as the last stage's
        loss function gives them (unscaled); the same on every process."""
        executor = self.executor
        modules = [runtime.module for runtime in executor.stages.values()]
        modes = [(module, module.training) for stage in modules for module in stage.modules()]
        state = _PassState(executor.step_end.loss_parts, executor.device)
        try:
            for stage in modules:
                stage.eval()
            with torch.no_grad(), executor.precision.step_casts():
                for action in self.actions:
                    self._perform(action, state)
        finally:
            for module, training in modes:
                module.training = training
        assert state.reduced is not None, "an evaluation plan ends with the world reduction"
        values = state.reduced.tolist()
        return {name: value / len(self.batches) for name, value in zip(("loss", *state.parts), values)}

    def _perform(self, action: Action, state: _PassState) -> None:
        executor, kind, target = self.executor, action.kind, action.target
        if kind is ActionKind.RUN:
            self._forward(action.op, state)
        elif kind is ActionKind.POST:
            shape, dtype = executor.message_spec(action.message)
            buffer = torch.empty(shape, dtype=dtype, device=executor.device)
            group, peer = action.link
            state.receives[action.message] = (buffer, executor.comm.recv(buffer, peer, group))
        elif kind is ActionKind.SEND:
            group, peer = action.link
            state.sends[action.message] = executor.comm.send(state.outputs.pop(action.message), peer, group)
        elif kind is ActionKind.LAUNCH:  # the world reduction of the losses, the pass's only collective
            state.reduced = torch.stack([state.total, *state.parts.values()])
            state.reduction = executor.comm.all_reduce([state.reduced], action.collective.group)
        elif isinstance(target, Message):
            buffer, handle = state.receives.pop(target)
            handle.wait()
            state.inputs[target] = buffer
        elif isinstance(target, SendDone):
            state.sends.pop(target.message).wait()
        else:
            assert state.reduction is not None, f"waiting for {target}, which this pass never launched"
            state.reduction.wait()

    def _forward(self, op: Op, state: _PassState) -> None:
        executor = self.executor
        stage = executor.stages[(op.pipe, op.stage)]
        num_stages = executor.topology.schedule.num_stages
        index = self.plan.topology.global_micro_batch(executor.rank, micro_batch_of(op))
        batch = state.batches.get(index)
        if batch is None:
            batch = state.batches[index] = DeviceBatch(dict(self.batches[index]), executor.device)
        inputs = None
        message = input_message(op, num_stages)
        if message is not None:  # every stage but the first
            inputs = state.inputs.pop(message) if message in state.inputs else state.outputs.pop(message)
        with stage.precision.autocast():
            output = stage.module(inputs, batch)
            if stage.last:
                loss, parts = stage.loss_fn(output, batch)
        sent = output_message(op, num_stages)
        if sent is not None:  # every stage but the last
            state.outputs[sent] = output.to(stage.precision.compute_dtype)
        elif executor.step_end.reports_loss:  # a tensor-parallel shard other than 0 computes the same loss
            state.total = state.total + loss.double()
            for name, value in parts.items():
                state.parts[name] = state.parts[name] + value.double()


class _PassState:
    """What one pass holds on its way: receives posted, sends in flight, activations received
    and produced, the micro-batches on the device, the loss sums and their reduction."""

    def __init__(self, parts: Sequence[str], device: torch.device):
        zero = torch.zeros((), dtype=torch.float64, device=device)
        self.total = zero
        self.parts: dict[str, Tensor] = dict.fromkeys(parts, zero)
        self.receives: dict[Message, tuple[Tensor, Handle]] = {}
        self.sends: dict[Message, Handle] = {}
        self.inputs: dict[Message, Tensor] = {}
        self.outputs: dict[Message, Tensor] = {}
        self.batches: dict[int, DeviceBatch] = {}
        self.reduced: Tensor | None = None
        self.reduction: Handle | None = None
