"""Capture per micro-batch, for any method: a layer's input ``a`` (part "A") and its output's
gradient ``e`` (part "B"), as hooks record them during the step's normal forwards and backwards.

No extra forward or backward pass: ``a`` is the tensor the layer already saves for its weight
gradient (stored without a copy, detached), ``e`` is read by a tensor hook on the layer output
during the normal backward, which may run long after the forward (pipeline schedules). Under
loss scaling, the micro-batch's loss scale is kept beside its ``e`` records.

Scaling: ``e`` is the gradient of the loss the stage backpropagates, the micro-batch's loss
times 1 / (micro-batches x data-parallel replicas) (and fp16's loss scale, kept in
``loss_scales``); a statistic that wants the per-row gradient of the unscaled mean loss
multiplies by `rows_per_step` (K-FAC's B factor does).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Hashable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from torch import Tensor, nn

from pipefisher.methods.blocks import Factor
from pipefisher.methods.inputs import MethodInputs
from pipefisher.runtime.primitives.recompute import recomputing

#: the part of a layer's input records
INPUTS: Factor = "A"
#: the part of a layer's output-gradient records
OUTPUT_GRADIENTS: Factor = "B"


class Capturing(Protocol):
    """Where `capture` records one layer: `module` (hooked), `captures[part][micro_batch]` (a list
    of detached tensors: one per forward of the layer in that micro-batch) and
    `loss_scales[micro_batch]` (fp16's scale of that micro-batch's "B" records)."""

    module: nn.Module
    captures: dict[Factor, dict[Hashable, list[Tensor]]]
    loss_scales: dict[Hashable, Tensor | float]


@dataclass
class CapturedLayer:
    """A ready `Capturing`: one layer's records, consumed (popped) by the method's statistics."""

    module: nn.Module
    captures: dict[Factor, dict[Hashable, list[Tensor]]] = field(default_factory=lambda: {"A": {}, "B": {}})
    loss_scales: dict[Hashable, Tensor | float] = field(default_factory=dict)

    def take(self, part: Factor, micro_batch: Hashable) -> tuple[list[Tensor], Tensor | float | None]:
        """Remove and return `micro_batch`'s records of `part` and its loss scale (None: unscaled;
        kept until the other part is taken too)."""
        records = self.captures[part].pop(micro_batch)
        other: Factor = "B" if part == "A" else "A"
        scale = self.loss_scales.get(micro_batch)
        if micro_batch not in self.captures[other]:
            self.loss_scales.pop(micro_batch, None)
        return records, scale

    def micro_batches(self, part: Factor) -> list[Hashable]:
        """The micro-batches with records of `part`, in capture order."""
        return list(self.captures[part])


def rows_per_step(config: MethodInputs[Any]) -> int:
    """Rows (tokens) a step's gradient sums over, every micro-batch and replica: the factor that
    turns a "B" record into the per-row gradient of the step's mean loss (`MethodInputs.rows_per_step`)."""
    return config.rows_per_step


#: what is stored of a record of a part: the detached tensor as it is, or something smaller
#: that the method's statistics read alike (K-FAC-reduce's per-sequence means)
Condense = Callable[[Factor, Tensor], Tensor]


def held_bytes(tensor: Tensor) -> int:
    """Bytes `tensor` holds: its elements but those a broadcast (stride-0) dimension repeats."""
    return math.prod(n for n, stride in zip(tensor.shape, tensor.stride()) if stride != 0) * tensor.element_size()


def _record(state: Capturing, micro_batch: Hashable, key: Factor, tensor: Tensor, condense: Condense | None) -> None:
    held = tensor.detach()
    state.captures[key].setdefault(micro_batch, []).append(held if condense is None else condense(key, held))


class _OutputGradHook:
    """Records a layer output's gradient the first time it is computed. A backward split into
    input and weight gradients (zero-bubble schedules) reaches the output twice with the same
    gradient; the second visit must not count again. (The first visit is at B for every layer
    whose input depends on the stage input, as in every shipped model; a layer fed only by
    parameters would get its gradient at W, after its curvature-B task.)"""

    def __init__(
        self, state: Capturing, micro_batch: Hashable, loss_scale: Tensor | float | None, condense: Condense | None
    ):
        self.state, self.micro_batch, self.loss_scale, self.condense = state, micro_batch, loss_scale, condense
        self.fired = False

    def __call__(self, grad: Tensor) -> None:
        if self.fired:
            return
        self.fired = True
        _record(self.state, self.micro_batch, "B", grad, self.condense)
        if self.loss_scale is not None:
            self.state.loss_scales[self.micro_batch] = self.loss_scale


def _forward_hook(
    state: Capturing,
    micro_batch: Hashable,
    loss_scale: Tensor | float | None,
    parts: Collection[Factor],
    condense: Condense | None,
    module: nn.Module,
    inputs: tuple,
    output: Tensor,
) -> None:
    if recomputing():  # the backward's second forward of a checkpointed block: recorded once, at the first
        return
    if "A" in parts:
        _record(state, micro_batch, "A", inputs[0], condense)
    if "B" in parts and output.requires_grad:
        output.register_hook(_OutputGradHook(state, micro_batch, loss_scale, condense))


@contextmanager
def capture(
    layers: Mapping[str, Capturing],
    micro_batch: Hashable,
    loss_scale: Tensor | float | None = None,
    parts: Collection[Factor] = ("A", "B"),
    condense: Condense | None = None,
) -> Iterator[None]:
    """Record ``a`` (part "A", `INPUTS`) for every forward of ``layers`` inside the block, keyed by
    ``micro_batch``, and ``e`` (part "B", `OUTPUT_GRADIENTS`) of those forwards when their
    backward runs, inside the block or later; `parts` says which of the two to record. Forwards
    under ``torch.no_grad`` record ``a`` only. ``loss_scale`` (None: unscaled) is stored as the
    micro-batch's scale with its ``e`` records; one scale per micro-batch. ``condense`` (None:
    the tensors themselves) makes what is stored of each record, detached, from its part and tensor.
    """
    handles = [
        st.module.register_forward_hook(partial(_forward_hook, st, micro_batch, loss_scale, tuple(parts), condense))
        for st in layers.values()
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
