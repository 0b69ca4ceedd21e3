"""Shampoo's every-step direction (`pipefisher.methods.shampoo.engine` states it) over many
matrices at once: with `stacked` (the engine's choice on a GPU) their blocks of equal shape are
stacked, so that each root product and norm is one batched kernel per group of blocks instead of
one per block. No host read."""

from __future__ import annotations

import torch
from torch import Tensor

from pipefisher.methods.block_stacks import block_products, stack, unstack
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
    matrix its products computed before (`block_products`, here or on a helper) or None to compute them
    now. `stacked`: same-shape blocks in one product (`block_groups`)."""
    left = [committed_roots(st, "A") for st in states]
    right = [committed_roots(st, "B") for st in states]
    found: list[Tensor | None] = list(held) if held is not None else [None] * len(states)
    missing = [i for i, product in enumerate(found) if product is None]
    if missing:
        computed = block_products(
            [states[i].info for i in missing],
            [block_views(left[i].value, states[i].info.block_sizes("A")) for i in missing],
            [block_views(right[i].value, states[i].info.block_sizes("B")) for i in missing],
            [grads[i] for i in missing],
            stacked,
        )
        for i, product in zip(missing, computed):
            found[i] = product
    oks = [a.ok & b.ok for a, b in zip(left, right)]
    out = [torch.empty_like(graft) for graft in grafts]
    for group in block_groups([(st.info, st.parameter.device) for st in states], stacked):
        graft = stack([grafts[b.matrix][b.rows, b.cols] for b in group])
        d = stack([_present(found[b.matrix])[b.rows, b.cols] for b in group])
        if graft_norm:
            d = transfer_norm(d, graft)
        ok = stack([oks[b.matrix][b.k] for b in group])
        chosen = torch.where(ok.reshape(ok.shape + (1, 1)), d, graft)
        torch._foreach_copy_([out[b.matrix][b.rows, b.cols] for b in group], unstack(chosen, len(group)))
    return out


def _present(product: Tensor | None) -> Tensor:
    if product is None:
        raise RuntimeError("a Shampoo product was not computed")
    return product
