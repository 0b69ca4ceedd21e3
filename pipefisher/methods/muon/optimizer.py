"""The step of Muon's matrices, once their scaled orthogonalised updates s·O are in `.grad`
(`MuonEngine.apply`): W ← W(1 − lr·wd) − lr·s·O, the decoupled weight decay first, as
`torch.optim.Muon` orders it."""

from __future__ import annotations

from typing import Any

import torch


class MuonStep(torch.optim.Optimizer):
    """Applies Muon's updates to `param_groups` (each may set its ``weight_decay``; default
    `weight_decay`) at learning rate `lr`. No state of its own: the momentum is the engine's. A
    parameter whose ``.grad`` is None is left alone."""

    def __init__(self, param_groups: Any, lr: float, weight_decay: float = 0.0):
        super().__init__(param_groups, {"lr": lr, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        if closure is not None:
            raise ValueError("MuonStep.step takes no closure")
        for group in self.param_groups:
            lr, decay = group["lr"], group["weight_decay"]
            for parameter in group["params"]:
                if parameter.grad is None:
                    continue
                if decay:
                    parameter.mul_(1 - lr * decay)
                parameter.add_(parameter.grad, alpha=-lr)
