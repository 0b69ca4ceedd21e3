"""The step of Muon's matrices, once their scaled orthogonalised updates s·O are in `.grad`
(`MuonEngine.apply`): W ← W(1 − lr·wd) − lr·s·O, the decoupled weight decay first, as
`torch.optim.Muon` orders it."""

from __future__ import annotations

from typing import Any

from pipefisher.optim.decoupled import DecoupledStep


class MuonStep(DecoupledStep):
    """Applies Muon's updates to `param_groups` (each may set its ``weight_decay``; default
    `weight_decay`) at learning rate `lr`. No state of its own: the momentum is the engine's."""

    def __init__(self, param_groups: Any, lr: float, weight_decay: float = 0.0):
        super().__init__(param_groups, lr, weight_decay, decay_first=True)
