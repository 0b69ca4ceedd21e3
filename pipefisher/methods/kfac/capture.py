"""Hooks recording a layer's input ``a`` and output gradient ``e`` for one micro-batch.

No extra forward or backward pass: ``a`` is the tensor the layer already saves for its weight
gradient (stored without a copy, detached), ``e`` is read by a tensor hook on the layer output
during the normal backward, which may run long after the forward (pipeline schedules). Under
loss scaling, the micro-batch's loss scale is kept beside its ``e`` records for curvature.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial

from torch import Tensor, nn

from pipefisher.methods.kfac.layer import LayerState
from pipefisher.runtime.pipeline.recompute import recomputing


def _record(state: LayerState, micro_batch: Hashable, key: str, tensor: Tensor) -> None:
    state.captures[key].setdefault(micro_batch, []).append(tensor.detach())  # type: ignore[index]


class _OutputGradHook:
    """Records a layer output's gradient the first time it is computed. A backward split into
    input and weight gradients (zero-bubble schedules) reaches the output twice with the same
    gradient; the second visit must not count again. (The first visit is at B for every layer
    whose input depends on the stage input, as in every shipped model; a layer fed only by
    parameters would get its gradient at W, after its curvature-B task.)"""

    def __init__(self, state: LayerState, micro_batch: Hashable, loss_scale: Tensor | float | None):
        self.state, self.micro_batch, self.loss_scale = state, micro_batch, loss_scale
        self.fired = False

    def __call__(self, grad: Tensor) -> None:
        if self.fired:
            return
        self.fired = True
        _record(self.state, self.micro_batch, "B", grad)
        if self.loss_scale is not None:
            self.state.loss_scales[self.micro_batch] = self.loss_scale


def _forward_hook(
    state: LayerState,
    micro_batch: Hashable,
    loss_scale: Tensor | float | None,
    module: nn.Module,
    inputs: tuple,
    output: Tensor,
) -> None:
    if recomputing():  # the backward's second forward of a checkpointed block: recorded once, at the first
        return
    _record(state, micro_batch, "A", inputs[0])
    if output.requires_grad:
        output.register_hook(_OutputGradHook(state, micro_batch, loss_scale))


@contextmanager
def capture(
    layers: Mapping[str, LayerState],
    micro_batch: Hashable,
    loss_scale: Tensor | float | None = None,
) -> Iterator[None]:
    """Record ``a`` for every forward of ``layers`` inside the block, keyed by ``micro_batch``.

    ``e`` of those forwards is recorded when their backward runs, inside the block or later;
    forwards under ``torch.no_grad`` record ``a`` only. ``loss_scale`` (None: unscaled) is stored
    as the micro-batch's scale with its ``e`` records; one scale per micro-batch.
    """
    handles = [
        st.module.register_forward_hook(partial(_forward_hook, st, micro_batch, loss_scale))
        for st in layers.values()
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
