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

from pipefisher.kfac.layer import LayerState


def _record(state: LayerState, micro_batch: Hashable, key: str, tensor: Tensor) -> None:
    state.captures[key].setdefault(micro_batch, []).append(tensor.detach())  # type: ignore[index]


def _record_output_grad(
    state: LayerState, micro_batch: Hashable, loss_scale: Tensor | float | None, grad: Tensor
) -> None:
    _record(state, micro_batch, "B", grad)
    if loss_scale is not None:
        state.loss_scales[micro_batch] = loss_scale


def _forward_hook(
    state: LayerState,
    micro_batch: Hashable,
    loss_scale: Tensor | float | None,
    module: nn.Module,
    inputs: tuple,
    output: Tensor,
) -> None:
    _record(state, micro_batch, "A", inputs[0])
    if output.requires_grad:
        output.register_hook(partial(_record_output_grad, state, micro_batch, loss_scale))


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
