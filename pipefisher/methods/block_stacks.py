"""Same-shape blocks of many matrices as one batch (`pipefisher.methods.blocks.block_groups`
chooses them): one batched product per group instead of one per block."""

from __future__ import annotations

import torch
from torch import Tensor

from pipefisher.methods.blocks import Block, MatrixInfo, block_groups


def stack(tensors: list[Tensor]) -> Tensor:
    """`tensors` (equal shapes) as one ``(b, ...)`` stack, or a lone one as it is (2-D products)."""
    return tensors[0] if len(tensors) == 1 else torch.stack(tensors)


def unstack(stacked: Tensor, count: int) -> list[Tensor]:
    """The `count` tensors of a `stack` result."""
    return [stacked] if count == 1 else list(stacked.unbind(0))


def block_products(
    infos: list[MatrixInfo], lefts: list[list[Tensor]], rights: list[list[Tensor]], grads: list[Tensor], stacked: bool
) -> list[Tensor]:
    """Per matrix of `infos` the product ``L_k G_k R_k`` of each block k of its gradient in
    `grads` (``(rows, cols)``) with the k-th of its left and right matrices in `lefts` and
    `rights` (per matrix, one square tensor per block, or views of them: Shampoo's roots, SOAP's
    transposed and plain eigenbases); ``(rows, cols)`` tensors, new. `stacked`: same-shape blocks
    in one product (`block_groups`)."""
    out = [torch.empty_like(grad) for grad in grads]
    for group in block_groups([(info, grad.device) for info, grad in zip(infos, grads)], stacked):
        d = (
            stack([lefts[b.matrix][b.k] for b in group])
            @ stack([grads[b.matrix][b.rows, b.cols] for b in group])
            @ stack([rights[b.matrix][b.k] for b in group])
        )
        torch._foreach_copy_([out[b.matrix][b.rows, b.cols] for b in group], unstack(d, len(group)))
    return out


def held_or_products(
    group: list[Block], left: Tensor, right: Tensor, grads: list[Tensor], held: list[Tensor | None]
) -> Tensor:
    """The blocks of `group` stacked: per matrix its block of `held` (a product computed before,
    in a P op or on a helper), or where that is None ``L_k G_k R_k`` of its gradient in `grads`
    with the group's stacked `left` and `right` matrices, computed now in one batched product."""
    fresh = [i for i, b in enumerate(group) if held[b.matrix] is None]
    if len(fresh) == len(group):
        return left @ stack([grads[b.matrix][b.rows, b.cols] for b in group]) @ right
    found = stack([_given(held[b.matrix], grads[b.matrix])[b.rows, b.cols] for b in group])
    if fresh:  # a mixed group: more than one block, so `found` is a new stack
        now = stack([left[i] for i in fresh]) @ stack([found[i] for i in fresh]) @ stack([right[i] for i in fresh])
        torch._foreach_copy_([found[i] for i in fresh], unstack(now, len(fresh)))
    return found


def _given(product: Tensor | None, grad: Tensor) -> Tensor:
    """A held product, else the gradient (multiplied later in the group's pass)."""
    return grad if product is None else product
