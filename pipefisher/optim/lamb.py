"""LAMB (You et al., "Large Batch Optimization for Deep Learning", ICLR 2020).

No maintained package provides it without heavy or unusable dependencies here (timm's Lamb pulls
in torchvision; apex's FusedLAMB is CUDA-only), so it is implemented in this module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor


class Lamb(torch.optim.Optimizer):
    """Per parameter p with gradient g, at step t (counted from 1):

        m ← β₁m + (1−β₁)g,  v ← β₂v + (1−β₂)g²,  m̂ = m/(1−β₁ᵗ),  v̂ = v/(1−β₂ᵗ)
        u = m̂/(√v̂ + eps) + weight_decay·p,  r = ‖p‖/‖u‖ (r = 1 if either norm is 0)
        p ← p − lr·r·u

    As NVIDIA's NVLAMB, the trust ratio applies to every parameter (biases and LayerNorm too);
    unlike it, gradients are not pre-normalised by their global norm (the runtime clips them).
    Norms are over the whole tensor. Parameters without a gradient are skipped.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
    ):
        if not lr >= 0.0:
            raise ValueError(f"lr: expected >= 0, got {lr!r}")
        if len(betas) != 2 or not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"betas: expected two numbers in [0, 1), got {betas!r}")
        if not eps >= 0.0:
            raise ValueError(f"eps: expected >= 0, got {eps!r}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay: expected >= 0, got {weight_decay!r}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One LAMB update of every parameter that has a gradient; returns closure() if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                step = state["step"]
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.lerp_(p.grad, 1.0 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1.0 - beta2)
                denominator = (exp_avg_sq / (1.0 - beta2**step)).sqrt_().add_(group["eps"])
                update = (exp_avg / (1.0 - beta1**step)).div_(denominator)
                if group["weight_decay"] != 0.0:
                    update.add_(p, alpha=group["weight_decay"])
                weight_norm, update_norm = p.norm(), update.norm()
                ratio = torch.where((weight_norm > 0) & (update_norm > 0), weight_norm / update_norm, 1.0)
                p.sub_(update.mul_(ratio * group["lr"]))
        return loss
