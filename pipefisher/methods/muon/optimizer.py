"""The step of Muon's matrices, once their orthogonalised updates are in `.grad` (`MuonEngine.apply`):
W ← W(1 − lr·wd) − lr·s·O, decoupled weight decay first, as `torch.optim.Muon` orders it."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


class MuonStep(torch.optim.Optimizer):
    """Applies orthogonalised updates: each parameter group holds `params` with their shape scales
    `scales` (one float each, `shape_scale`), `lr` and `weight_decay`; no state of its own (the
    momentum is the engine's)."""

    def __init__(self, matrices: Iterable[tuple[nn.Parameter, float]], lr: float, weight_decay: float = 0.0):
        pairs = list(matrices)
        group = {"params": [p for p, _ in pairs], "scales": [s for _, s in pairs]}
        super().__init__([group], {"lr": lr, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, decay = group["lr"], group["weight_decay"]
            for parameter, scale in zip(group["params"], group["scales"]):
                if parameter.grad is None:
                    continue
                parameter.mul_(1 - lr * decay)
                parameter.add_(parameter.grad, alpha=-lr * scale)
        return None
