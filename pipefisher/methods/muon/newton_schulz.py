"""Muon's maths on one matrix: the momentum step, the quintic Newton–Schulz orthogonalisation and
the shape scale of the step (Jordan et al. 2024; Liu et al. 2025 for ``match_rms_adamw``).

For a gradient G of a (rows, cols) weight, momentum μ, the buffer B:

    B ← μB + (1 − μ)G                       (as a lerp, B.lerp(G, 1 − μ))
    U = G + μ(B − G) with Nesterov, else B  (G.lerp(B, μ))
    X₀ = U / max(‖U‖_F, eps), transposed when rows > cols so that X X ᵀ is the smaller Gram matrix
    X ← aX + (b A + c A²) X,  A = X Xᵀ,  ns_steps times
    O = X (transposed back)

and the weight steps W ← W(1 − lr·wd) − lr·s·O with the shape scale s of `shape_scale`. These are
the operations and their order in `torch.optim.Muon`, so with the bfloat16 iteration the result
is torch's to the bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from pipefisher.methods.dtypes import torch_dtype
from pipefisher.methods.muon.method import ADJUST_LR, AdjustLr, MuonConfig


def orthogonalise(update: Tensor, settings: MuonConfig) -> Tensor:
    """The Newton–Schulz orthogonalisation of a 2-D `update`, or of each matrix of a
    ``(batch, rows, cols)`` stack alone, in `settings.ns_dtype` (a new tensor, same shape). Its
    singular values end near 1 (the quintic is tuned for speed, not convergence: roughly within
    [0.7, 1.2]); a zero matrix stays zero. A stack costs one kernel per product for all its
    matrices (`torch.baddbmm`); a 2-D update takes `torch.addmm`, as `torch.optim.Muon`."""
    if update.dim() not in (2, 3):
        raise ValueError(f"Muon orthogonalises matrices or stacks of them, got shape {tuple(update.shape)}")
    a, b, c = settings.ns_coefficients
    x = update.to(torch_dtype(settings.ns_dtype))
    tall = update.size(-2) > update.size(-1)
    if tall:
        x = x.mT
    norm = x.norm() if x.dim() == 2 else torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    x = x.div(norm.clamp(min=settings.eps))
    multiply_add = torch.addmm if x.dim() == 2 else torch.baddbmm
    for _ in range(settings.ns_steps):
        gram = x @ x.mT
        polynomial = multiply_add(gram, gram, gram, beta=b, alpha=c)
        x = multiply_add(x, polynomial, x, beta=a)
    return x.mT if tall else x


def momentum_update(
    buffers: list[Tensor], gradients: list[Tensor], settings: MuonConfig
) -> tuple[Sequence[Tensor], Sequence[Tensor]]:
    """(the new buffers, what is orthogonalised) from the old `buffers` and `gradients` (equal
    shapes pairwise; foreach kernels); `buffers` are left as they are (the step may be skipped)."""
    new = torch._foreach_lerp(buffers, gradients, 1 - settings.momentum)
    return new, torch._foreach_lerp(gradients, new, settings.momentum) if settings.nesterov else new


def shape_scale(rows: int, cols: int, rule: AdjustLr) -> float:
    """The factor on the learning rate of a (rows, cols) matrix's step: ``original``
    √max(1, rows/cols), ``match_rms_adamw`` 0.2·√max(rows, cols) (an update RMS like AdamW's)."""
    if rule == "original":
        return math.sqrt(max(1.0, rows / cols))
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"adjust_lr: {rule!r} is not one of {', '.join(ADJUST_LR)}")
