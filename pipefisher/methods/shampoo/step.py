"""Shampoo's every-step direction (`pipefisher.methods.shampoo.engine` states it) over many
matrices at once: with `stacked` (the engine's choice on a GPU) their blocks of equal shape are
stacked, so that each root product and norm is one batched kernel per group of blocks instead of
one per block. No host read."""

from __future__ import annotations

import torch
from torch import Tensor

from pipefisher.methods.blocks import Factor, block_groups, block_views
from pipefisher.methods.shampoo.grafting import transfer_norm
from pipefisher.methods.shampoo.state import MatrixState, Roots


def _committed(st: MatrixState, factor: Factor) -> Roots:
    roots = st.factors[factor].committed
    if roots is None:
        raise RuntimeError(f"Shampoo matrix {st.info.name!r}: no committed {factor} roots")
    return roots


def directions(
    states: list[MatrixState], grads: list[Tensor], grafts: list[Tensor], graft_norm: bool, stacked: bool
) -> list[Tensor]:
    """Per matrix of `states` (with committed roots of both factors) the direction
    ``L_k^(-1/4) G_k R_k^(-1/4)`` of each block k of its gradient in `grads` (``(rows, cols)``),
    rescaled to the norm of the block of `grafts` (same shapes) when `graft_norm`, and that
    grafting block itself where a root is not ok; ``(rows, cols)`` tensors, new. `stacked`:
    same-shape blocks in one product (`block_groups`)."""
    left = [_committed(st, "A") for st in states]
    right = [_committed(st, "B") for st in states]
    oks = [a.ok & b.ok for a, b in zip(left, right)]
    left_views = [block_views(r.value, st.info.block_sizes("A")) for r, st in zip(left, states)]
    right_views = [block_views(r.value, st.info.block_sizes("B")) for r, st in zip(right, states)]
    out = [torch.empty_like(graft) for graft in grafts]
    for group in block_groups([(st.info, st.parameter.device) for st in states], stacked):
        graft = _stack([grafts[b.matrix][b.rows, b.cols] for b in group])
        d = (
            _stack([left_views[b.matrix][b.k] for b in group])
            @ _stack([grads[b.matrix][b.rows, b.cols] for b in group])
            @ _stack([right_views[b.matrix][b.k] for b in group])
        )
        if graft_norm:
            d = transfer_norm(d, graft)
        ok = _stack([oks[b.matrix][b.k] for b in group])
        chosen = torch.where(ok.reshape(ok.shape + (1, 1)), d, graft)
        torch._foreach_copy_([out[b.matrix][b.rows, b.cols] for b in group], _unstack(chosen, len(group)))
    return out


def _stack(tensors: list[Tensor]) -> Tensor:
    """`tensors` (equal shapes) as one ``(b, ...)`` stack, or a lone one as it is (2-D products)."""
    return tensors[0] if len(tensors) == 1 else torch.stack(tensors)


def _unstack(stack: Tensor, count: int) -> list[Tensor]:
    """The `count` tensors of a `_stack` result."""
    return [stack] if count == 1 else list(stack.unbind(0))
