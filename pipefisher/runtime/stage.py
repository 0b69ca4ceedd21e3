"""One (pipe, stage) held by a rank: its module and the activations of micro-batches in flight."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

LossFn = Callable[[Tensor, Tensor], Tensor]


class StageRuntime:
    """Runs forward and backward of one stage, keyed by micro-batch id.

    The last stage turns its output into a loss with `loss_fn(output, target) × loss_scale`
    (loss_scale = 1 / micro-batches of the whole step, so gradients are those of the mean).
    Activations are dropped as soon as their backward has run.
    """

    def __init__(self, pipe: int, stage: int, module: nn.Module, first: bool, last: bool, loss_fn: LossFn, loss_scale: float):
        self.pipe, self.stage, self.module = pipe, stage, module
        self.first, self.last = first, last
        self.loss_fn, self.loss_scale = loss_fn, loss_scale
        self._inputs: dict[int, Tensor] = {}
        self._outputs: dict[int, Tensor] = {}
        self.losses: dict[int, Tensor] = {}

    def forward(self, micro_batch: int, inputs: Tensor, target: Tensor | None = None) -> Tensor | None:
        """Run the stage; return the activation to pass on (None on the last stage)."""
        if not self.first:
            inputs = inputs.detach().requires_grad_(True)
        output = self.module(inputs)
        self._inputs[micro_batch] = inputs
        if self.last:
            loss = self.loss_fn(output, target) * self.loss_scale
            self.losses[micro_batch] = loss.detach()  # summed once per step: no device sync per micro-batch
            self._outputs[micro_batch] = loss
            return None
        self._outputs[micro_batch] = output
        return output.detach()

    def backward(self, micro_batch: int, grad_output: Tensor | None = None) -> Tensor | None:
        """Backpropagate one micro-batch; return the gradient for the previous stage (None on the first)."""
        output = self._outputs.pop(micro_batch)
        inputs = self._inputs.pop(micro_batch)
        torch.autograd.backward(output, grad_tensors=None if self.last else grad_output)
        return None if self.first else inputs.grad

    @property
    def in_flight(self) -> int:
        return len(self._outputs)

    def take_loss(self) -> float:
        """Sum of this step's (scaled) micro-batch losses; resets."""
        total = float(torch.stack(list(self.losses.values())).sum()) if self.losses else 0.0
        self.losses = {}
        return total
