"""One (pipe, stage) held by a rank: its module and the activations of micro-batches in flight."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor, nn

from pipefisher.runtime.gradient_path.precision import Precision
from pipefisher.runtime.pipeline.split_backward import SplitBackward

#: (last stage's output, micro-batch) -> (loss, named parts)
LossFn = Callable[[object, Mapping[str, Tensor]], tuple[Tensor, dict[str, Tensor]]]


class StageRuntime:
    """Runs forward and backward of one stage, keyed by micro-batch id.

    The forward runs under the run's autocast and hands the next stage its output in the compute
    dtype. The last stage turns its output into a loss with `loss_fn(output, batch) × loss_scale`
    (loss_scale = 1 / micro-batches of the whole step, so gradients are those of the mean), and
    backpropagates that times `grad_scale()` (fp16's dynamic loss scale; None = 1). Activations
    are dropped as soon as their backward has run. Losses stay on the device. After
    `split_backward()` (zero-bubble schedules), `backward` computes the input gradient only and
    `weight` the micro-batch's weight gradient (`pipefisher.runtime.pipeline.split_backward`).
    """

    def __init__(
        self,
        pipe: int,
        stage: int,
        module: nn.Module,
        first: bool,
        last: bool,
        loss_fn: LossFn,
        loss_scale: float,
        precision: Precision,
        grad_scale: Callable[[], Tensor | None] = lambda: None,
    ):
        self.pipe, self.stage, self.module = pipe, stage, module
        self.first, self.last = first, last
        self.loss_fn, self.loss_scale = loss_fn, loss_scale
        self.precision, self.grad_scale = precision, grad_scale
        self._inputs: dict[int, Tensor | None] = {}
        self._outputs: dict[int, Tensor] = {}
        self.losses: list[Tensor] = []
        self.parts: dict[str, list[Tensor]] = {}
        self.split: SplitBackward | None = None

    def split_backward(self) -> None:
        """From now on, backward computes input gradients and `weight` the weight gradients."""
        self.split = SplitBackward(self.module)

    def forward(self, micro_batch: int, inputs: Tensor | None, batch: Mapping[str, Tensor]) -> Tensor | None:
        """Run the stage on the previous stage's activation (None on the first stage) and the
        micro-batch; return the activation to pass on (None on the last stage)."""
        if not self.first:
            inputs = _given(inputs, "the previous stage's activation").detach().requires_grad_(True)
        with self.precision.autocast():
            output = self.module(inputs, batch)
            if self.last:
                loss, parts = self.loss_fn(output, batch)
        self._inputs[micro_batch] = inputs
        if self.last:
            loss = loss * self.loss_scale
            self.losses.append(loss.detach())
            for name, value in parts.items():
                self.parts.setdefault(name, []).append(value.detach() * self.loss_scale)
            scale = self.grad_scale()
            self._outputs[micro_batch] = loss if scale is None else loss * scale
            return None
        self._outputs[micro_batch] = output
        return output.detach().to(self.precision.compute_dtype)

    def backward(self, micro_batch: int, grad_output: Tensor | None = None) -> Tensor | None:
        """Backpropagate one micro-batch; return the gradient for the previous stage (None on the first)."""
        output = self._outputs.pop(micro_batch)
        inputs = self._inputs.pop(micro_batch)  # None on the first stage
        grad = None if self.last else _given(grad_output, "the next stage's gradient").to(output.dtype)
        if self.split is not None:
            return self.split.input_gradient(micro_batch, output, grad, inputs)
        torch.autograd.backward(output, grad_tensors=grad)
        return None if self.first else _given(inputs, "the stage's input").grad

    def weight(self, micro_batch: int) -> None:
        """Accumulate the weight gradient of a micro-batch whose input gradient has run."""
        if self.split is None:
            raise RuntimeError(f"stage {self.stage}: a weight gradient without split_backward()")
        self.split.weight_gradient(micro_batch)

    @property
    def pending_weights(self) -> int:
        """Micro-batches whose input gradient has run and weight gradient has not."""
        return 0 if self.split is None else self.split.pending

    @property
    def in_flight(self) -> int:
        return len(self._outputs)

    def take_loss(self) -> tuple[Tensor | None, dict[str, Tensor]]:
        """Sums of this step's (scaled) micro-batch losses and of their named parts, on the device
        (None on a stage without loss); resets."""
        total = torch.stack(self.losses).sum() if self.losses else None
        parts = {name: torch.stack(values).sum() for name, values in self.parts.items()}
        self.losses, self.parts = [], {}
        return total, parts


def _given(tensor: Tensor | None, what: str) -> Tensor:
    """`tensor`, which this stage's place in the pipeline needs (ValueError naming `what` when it is None)."""
    if tensor is None:
        raise ValueError(f"{what} is missing")
    return tensor
