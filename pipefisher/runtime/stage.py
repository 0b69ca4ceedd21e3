"""One (pipe, stage) held by a rank: its module and the activations of micro-batches in flight."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

#: (last stage's output, micro-batch) -> (loss, named parts)
LossFn = Callable[[object, dict[str, Tensor]], tuple[Tensor, dict[str, Tensor]]]


class StageRuntime:
    """Runs forward and backward of one stage, keyed by micro-batch id.

    The last stage turns its output into a loss with `loss_fn(output, batch) × loss_scale`
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
        self.parts: dict[str, list[Tensor]] = {}

    def forward(self, micro_batch: int, inputs: Tensor | None, batch: dict[str, Tensor]) -> Tensor | None:
        """Run the stage on the previous stage's activation (None on the first stage) and the
        micro-batch; return the activation to pass on (None on the last stage)."""
        if not self.first:
            inputs = inputs.detach().requires_grad_(True)
        output = self.module(inputs, batch)
        self._inputs[micro_batch] = inputs
        if self.last:
            loss, parts = self.loss_fn(output, batch)
            loss = loss * self.loss_scale
            self.losses[micro_batch] = loss.detach()  # summed once per step: no device sync per micro-batch
            for name, value in parts.items():
                self.parts.setdefault(name, []).append(value.detach() * self.loss_scale)
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

    def take_loss(self) -> tuple[float, dict[str, float]]:
        """Sums of this step's (scaled) micro-batch losses and of their named parts; resets."""
        total = float(torch.stack(list(self.losses.values())).sum()) if self.losses else 0.0
        parts = {name: float(torch.stack(values).sum()) for name, values in self.parts.items()}
        self.losses, self.parts = {}, {}
        return total, parts
