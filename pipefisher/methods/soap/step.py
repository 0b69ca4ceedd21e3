"""SOAP's every-step maths (`pipefisher.methods.soap.engine` states it) over many matrices at once:
with `stacked` (the engine's choice on a GPU) their blocks of equal shape are stacked, so that
each product is one batched kernel (`torch.bmm`) per group of blocks instead of one per block;
the per-matrix elementwise work is one foreach kernel over the matrices. The results are written
back into each matrix's tensors. No host read.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from pipefisher.methods.block_stacks import block_products, held_or_products, stack, unstack
from pipefisher.methods.blocks import Block, Factor, block_groups, block_views
from pipefisher.methods.soap.health import SKIPPED_STATISTICS
from pipefisher.methods.soap.method import SoapConfig
from pipefisher.methods.soap.state import MatrixState


def _groups(states: list[MatrixState], stacked: bool) -> list[list[Block]]:
    return block_groups([(st.info, st.parameter.device) for st in states], stacked)


def _factor_views(states: list[MatrixState], factor: Factor, attribute: str) -> list[list[Tensor]]:
    """Per matrix, the block views of `factor`'s flat tensor `attribute` ("statistic" or "basis")."""
    return [block_views(getattr(st.factors[factor], attribute), st.info.block_sizes(factor)) for st in states]


def fold(
    states: list[MatrixState], grads: list[Tensor], settings: SoapConfig, statistics_dtype: torch.dtype, stacked: bool
) -> None:
    """``S <- lerp(S, G Gᵀ or Gᵀ G, 1 - β_s)`` for every block and factor of `states` with their
    `grads` (``(rows, cols)`` each); a matrix whose gradient is not finite keeps its statistics
    and counts it (device-side). `stacked`: same-shape blocks in one product (`block_groups`)."""
    converted = [g.to(statistics_dtype) for g in grads]
    finite = [torch.isfinite(g).all() for g in converted]
    zero = [torch.zeros((), dtype=statistics_dtype, device=g.device) for g in converted]
    cleaned = [torch.where(ok, g, z) for ok, g, z in zip(finite, converted, zero)]
    weights = [torch.where(ok, 1.0 - settings.statistics_decay, 0.0).to(statistics_dtype) for ok in finite]
    views = {factor: _factor_views(states, factor, "statistic") for factor in ("A", "B")}
    for group in _groups(states, stacked):
        g = stack([cleaned[b.matrix][b.rows, b.cols] for b in group])
        weight = [weights[b.matrix] for b in group]
        for factor, product in (("A", g @ g.mT), ("B", g.mT @ g)):
            targets = [views[factor][b.matrix][b.k] for b in group]
            torch._foreach_lerp_(targets, unstack(product, len(group)), weight)
    for st, ok in zip(states, finite):
        st.counters[SKIPPED_STATISTICS].add_(~ok)


def rotate_in(states: list[MatrixState], grads: list[Tensor], stacked: bool) -> list[Tensor]:
    """Each of `grads` (``(rows, cols)``, of started `states`) in its blocks' eigenbases in use,
    ``Q_Lᵀ G Q_R`` per block; new tensors. Linear in the gradient: a P op takes it before clipping
    and fp16's unscaling, and the step end scales it (`SoapEngine.precondition_all`)."""
    lefts = [[q.mT for q in views] for views in _factor_views(states, "A", "basis")]
    return block_products([st.info for st in states], lefts, _factor_views(states, "B", "basis"), grads, stacked)


def directions(
    states: list[MatrixState],
    grads: list[Tensor],
    settings: SoapConfig,
    stacked: bool,
    held: list[Tensor | None] | None = None,
) -> list[Tensor]:
    """SOAP's bias-corrected direction of each started matrix of `states` from its gradient in
    `grads` (``(rows, cols)``), updating their moments and direction counts. `held`: per matrix
    its gradient rotated into its eigenbases before (`rotate_in` in a P op, here or on a helper,
    scaled to this gradient), or None to rotate it here, in the same batched pass. Both moments
    live in each block's eigenbasis (`SoapEngine.commit` rotates ``m`` when the basis changes), so
    a block's step is the rotation in (unless held) and the direction rotated out."""
    for st in states:
        st.updates += 1
    found: list[Tensor | None] = list(held) if held is not None else [None] * len(states)
    out = [torch.empty_like(g) for g in grads]
    left, right = _factor_views(states, "A", "basis"), _factor_views(states, "B", "basis")
    for group in _groups(states, stacked):
        q_left = stack([left[b.matrix][b.k] for b in group])
        q_right = stack([right[b.matrix][b.k] for b in group])
        turned = held_or_products(group, q_left.mT, q_right, grads, found)
        first = [states[b.matrix].exp_avg[b.rows, b.cols] for b in group]
        second = [states[b.matrix].exp_avg_sq[b.rows, b.cols] for b in group]
        torch._foreach_lerp_(first, unstack(turned, len(group)), 1.0 - settings.beta1)
        torch._foreach_lerp_(second, unstack(turned.square(), len(group)), 1.0 - settings.beta2)
        direction = q_left @ (stack(first) / (stack(second).sqrt() + settings.epsilon)) @ q_right.mT
        torch._foreach_copy_([out[b.matrix][b.rows, b.cols] for b in group], unstack(direction, len(group)))
    corrections = [math.sqrt(1.0 - settings.beta2**st.updates) / (1.0 - settings.beta1**st.updates) for st in states]
    torch._foreach_mul_(out, corrections)
    return out
