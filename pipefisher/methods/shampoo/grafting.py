"""Grafting: the direction a parameter takes without Shampoo, and the per-block norm transfer.

Adam: ``v <- β v + (1 - β) G²``, direction ``G / (sqrt(v / (1 - β^t)) + ε)`` (Adam without
momentum). SGD and none: ``G``. All tensors in one float dtype and on one device; no host read.
"""

from __future__ import annotations

import torch
from torch import Tensor


def graft_direction(grad: Tensor, exp_avg_sq: Tensor | None, step: int, beta2: float, epsilon: float) -> Tensor:
    """The grafting direction of ``grad`` at precondition call ``step`` (1-based), a new tensor.

    Adam grafting (``β = beta2``, ``ε = epsilon``) has the second moment ``exp_avg_sq`` (same
    shape and dtype as ``grad``), updated in place first; SGD and no grafting have None.
    """
    if exp_avg_sq is None:
        return grad.clone()
    b2 = beta2
    exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1.0 - b2)
    denominator = (exp_avg_sq / (1.0 - b2**step)).sqrt_().add_(epsilon)
    return grad / denominator


def transfer_norm(shampoo: Tensor, graft: Tensor) -> Tensor:
    """``shampoo · ||graft||_F / ||shampoo||_F`` (zero where ``shampoo`` is zero): Shampoo's
    direction with the grafting direction's step size, for one block ``(r, c)`` or each of a
    stack ``(b, r, c)`` of them."""
    s_norm = torch.linalg.vector_norm(shampoo, dim=(-2, -1), keepdim=True)
    g_norm = torch.linalg.vector_norm(graft, dim=(-2, -1), keepdim=True)
    safe = torch.where(s_norm > 0, s_norm, torch.ones_like(s_norm))
    return shampoo * (g_norm / safe)
