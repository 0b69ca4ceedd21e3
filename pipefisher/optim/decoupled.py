"""The step of a method that writes its whole direction into `.grad` (Muon, SOAP): plain descent
with decoupled weight decay, in the order the method's authors apply the two."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from pipefisher.optim.update_step import UpdateStep


class DecoupledStep(UpdateStep):
    """p ← p(1 − lr·wd) − lr·d with `decay_first` (torch's Muon), else p ← (p − lr·d)(1 − lr·wd)
    (pytorch_optimizer's SOAP); d is ``.grad``, wd each group's ``weight_decay``. A parameter
    whose ``.grad`` is None is left alone. With `skip_first`, a parameter's first step changes
    nothing, weight decay included (its state is that count of steps, ``step``)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        weight_decay: float = 0.0,
        *,
        decay_first: bool,
        skip_first: bool = False,
    ) -> None:
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})
        self.decay_first, self.skip_first = decay_first, skip_first

    def update(self) -> None:
        for group in self.param_groups:
            lr, decay = group["lr"], group["weight_decay"]
            for parameter in group["params"]:
                if parameter.grad is None or self._skipped(parameter):
                    continue
                if decay and self.decay_first:
                    parameter.mul_(1 - lr * decay)
                parameter.add_(parameter.grad, alpha=-lr)
                if decay and not self.decay_first:
                    parameter.mul_(1 - lr * decay)

    def _skipped(self, parameter: torch.Tensor) -> bool:
        """Counts the parameter's steps when `skip_first`; whether this is its first."""
        if not self.skip_first:
            return False
        state = self.state[parameter]
        state["step"] = state.get("step", 0) + 1
        return state["step"] == 1
