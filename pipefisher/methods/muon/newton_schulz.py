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

import torch
from torch import Tensor

from pipefisher.methods.dtypes import torch_dtype
from pipefisher.methods.muon.method import ADJUST_LR, AdjustLr, MuonConfig


def orthogonalise(update: Tensor, settings: MuonConfig) -> Tensor:
    """The Newton–Schulz orthogonalisation of a 2-D `update`, in `settings.ns_dtype` (a new tensor,
    same shape). Its singular values end near 1 (the quintic is tuned for speed, not convergence:
    roughly within [0.7, 1.2]); a zero matrix stays zero."""
    if update.dim() != 2:
        raise ValueError(f"Muon orthogonalises matrices, got shape {tuple(update.shape)}")
    a, b, c = settings.ns_coefficients
    x = update.to(torch_dtype(settings.ns_dtype))
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x = x.div(x.norm().clamp(min=settings.eps))
    for _ in range(settings.ns_steps):
        gram = x @ x.T
        polynomial = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, polynomial, x, beta=a)
    return x.T if tall else x


def momentum_update(buffer: Tensor, gradient: Tensor, settings: MuonConfig) -> tuple[Tensor, Tensor]:
    """(the new buffer, what is orthogonalised) from the old `buffer` and `gradient`; `buffer` is
    left as it is (the step may still be skipped)."""
    new = buffer.lerp(gradient, 1 - settings.momentum)
    return new, gradient.lerp(new, settings.momentum) if settings.nesterov else new


def shape_scale(rows: int, cols: int, rule: AdjustLr) -> float:
    """The factor on the learning rate of a (rows, cols) matrix's step: ``original``
    √max(1, rows/cols), ``match_rms_adamw`` 0.2·√max(rows, cols) (an update RMS like AdamW's)."""
    if rule == "original":
        return math.sqrt(max(1.0, rows / cols))
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"adjust_lr: {rule!r} is not one of {', '.join(ADJUST_LR)}")
