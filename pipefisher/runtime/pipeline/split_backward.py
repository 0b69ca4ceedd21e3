"""A stage's backward split in two, for zero-bubble schedules: the input gradient (op B, on the
critical path: the previous stage waits for it) and the weight gradient (op W, which the schedule
may run later).

B differentiates the stage output with respect to the stage input only, and keeps, for every
group of parameters, the gradient that reached the nodes where the parameters' paths join the
input's path; W differentiates from those nodes to the parameters and accumulates into `.grad`.
So W does not run the input path again. This is PyTorch's own split
(`torch.distributed.pipelining._backward`, which its zero-bubble schedules use); pipefisher calls
it here. Where the stage output does not depend on a differentiable input (the first stage,
whose input is token ids), nothing would join the input's path: that stage runs its whole
backward at B and its W is empty (the same gradients; the schedule loses that W's freedom).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.autograd.graph import Node
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

#: what W needs, held from B until W: PyTorch's parameter groups (saved nodes and their gradients)
Pending = list[dict]


def _node_of(tensor: Tensor) -> Node | None:
    """The autograd node a gradient reaches `tensor` through (a leaf's gradient accumulator)."""
    if tensor.grad_fn is not None:
        return tensor.grad_fn
    view = tensor.view_as(tensor).grad_fn if tensor.requires_grad else None
    return None if view is None else view.next_functions[0][0]


def _reachable(root: Node) -> set[Node]:
    """Every autograd node the gradient of `root`'s output flows through."""
    seen, stack = {root}, [root]
    while stack:
        for child, _ in stack.pop().next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    return seen


class SplitBackward:
    """Input/weight gradients of one stage's micro-batches (see the module docstring).

    `input_gradient` returns d(loss)/d(stage input) (None where the stage has no differentiable
    input) and leaves the micro-batch's weight work pending; `weight_gradient` does it."""

    def __init__(self, module: nn.Module):
        self.parameters = [p for p in module.parameters() if p.requires_grad]
        self._pending: dict[int, Pending | None] = {}
        #: whether the split covers every parameter (decided at the first backward)
        self.splits: bool | None = None

    @staticmethod
    def _reaches_input(output: Tensor, inputs: Tensor | None) -> bool:
        """Whether the gradient of `output` flows into `inputs`. Then every parameter it flows
        into joins the input's path at the latest at `output` itself, so the split covers it."""
        root = _node_of(output)
        node = None if inputs is None else _node_of(inputs)
        return root is not None and node is not None and node in _reachable(root)

    def input_gradient(
        self, micro_batch: int, output: Tensor, grad_output: Tensor | None, inputs: Tensor | None
    ) -> Tensor | None:
        """Backward of `output` (the loss where `grad_output` is None) into `inputs`."""
        if self.splits is None:
            self.splits = self._reaches_input(output, inputs)
        if not self.splits:
            torch.autograd.backward(output, grad_tensors=grad_output)
            self._pending[micro_batch] = None
            return None if inputs is None else inputs.grad
        if output._base is not None:  # PyTorch's split detaches the output in place, which a view refuses
            output = output.clone()
        grads, groups = stage_backward_input(
            [output], None if grad_output is None else [grad_output], [inputs], iter(self.parameters)
        )
        self._pending[micro_batch] = groups
        return grads[0]

    def weight_gradient(self, micro_batch: int) -> None:
        """Accumulate the micro-batch's weight gradients into the parameters' `.grad`."""
        groups = self._pending.pop(micro_batch)
        if groups is not None:
            stage_backward_weight(iter(self.parameters), groups)

    @property
    def pending(self) -> int:
        """Micro-batches whose weight gradient has not run yet."""
        return len(self._pending)
