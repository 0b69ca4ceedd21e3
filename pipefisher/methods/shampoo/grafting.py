"""Grafting: the direction a parameter takes without Shampoo, and the per-block norm transfer.

Adam: ``v <- β v + (1 - β) G²``, direction ``G / (sqrt(v / (1 - β^t)) + ε)`` (Adam without
momentum). SGD and none: ``G``. All tensors in one float dtype and on one device; no host read.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pipefisher.methods.shampoo.settings import ShampooSettings


def graft_direction(grad: Tensor, exp_avg_sq: Tensor | None, settings: ShampooSettings, step: int) -> Tensor:
    """The grafting direction of ``grad`` at precondition call ``step`` (1-based), a new tensor.

    With Adam grafting ``exp_avg_sq`` (same shape and dtype as ``grad``) is updated in place
    first; otherwise it is unused (None).
    """
    if settings.grafting != "adam":
        return grad.clone()
    if exp_avg_sq is None:
        raise ValueError("Adam grafting needs its second-moment state")
    b2 = settings.graft_beta2
    exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1.0 - b2)
    denominator = (exp_avg_sq / (1.0 - b2**step)).sqrt_().add_(settings.graft_epsilon)
    return grad / denominator


def transfer_norm(shampoo: Tensor, graft: Tensor) -> Tensor:
    """``shampoo · ||graft||_F / ||shampoo||_F`` (zero where ``shampoo`` is zero): Shampoo's
    direction with the grafting direction's step size, for one block."""
    s_norm = torch.linalg.vector_norm(shampoo)
    g_norm = torch.linalg.vector_norm(graft)
    safe = torch.where(s_norm > 0, s_norm, torch.ones_like(s_norm))
    return shampoo * (g_norm / safe)
