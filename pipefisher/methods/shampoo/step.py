"""Shampoo's every-step direction (`pipefisher.methods.shampoo.engine` states it) over many
matrices at once: with `stacked` (the engine's choice on a GPU) their blocks of equal shape are
stacked, so that each root product and norm is one batched kernel per group of blocks instead of
one per block. No host read."""

from __future__ import annotations

import torch
from torch import Tensor

from pipefisher.methods.block_stacks import held_or_products, stack, unstack
from pipefisher.methods.blocks import block_groups, block_views
from pipefisher.methods.shampoo.grafting import transfer_norm
from pipefisher.methods.shampoo.state import MatrixState, committed_roots


def directions(
    states: list[MatrixState],
    grads: list[Tensor],
    grafts: list[Tensor],
    graft_norm: bool,
    stacked: bool,
    held: list[Tensor | None] | None = None,
) -> list[Tensor]:
    """Per matrix of `states` (with committed roots of both factors) the direction
    ``L_k^(-1/4) G_k R_k^(-1/4)`` of each block k of its gradient in `grads` (``(rows, cols)``),
    rescaled to the norm of the block of `grafts` (same shapes) when `graft_norm`, and that
    grafting block itself where a root is not ok; ``(rows, cols)`` tensors, new. `held`: per
    matrix its products computed before (`block_products`, here or on a helper) or None to compute
    them now, in the group's batched pass (`held_or_products`). `stacked`: same-shape blocks in one
    product (`block_groups`)."""
    left = [committed_roots(st, "A") for st in states]
    right = [committed_roots(st, "B") for st in states]
    left_views = [block_views(r.value, st.info.block_sizes("A")) for r, st in zip(left, states)]
    right_views = [block_views(r.value, st.info.block_sizes("B")) for r, st in zip(right, states)]
    found: list[Tensor | None] = list(held) if held is not None else [None] * len(states)
    oks = [a.ok & b.ok for a, b in zip(left, right)]
    out = [torch.empty_like(graft) for graft in grafts]
    for group in block_groups([(st.info, st.parameter.device) for st in states], stacked):
        graft = stack([grafts[b.matrix][b.rows, b.cols] for b in group])
        d = held_or_products(
            group,
            stack([left_views[b.matrix][b.k] for b in group]),
            stack([right_views[b.matrix][b.k] for b in group]),
            grads,
            found,
        )
        if graft_norm:
            d = transfer_norm(d, graft)
        ok = stack([oks[b.matrix][b.k] for b in group])
        chosen = torch.where(ok.reshape(ok.shape + (1, 1)), d, graft)
        torch._foreach_copy_([out[b.matrix][b.rows, b.cols] for b in group], unstack(chosen, len(group)))
    return out
