"""The base of the optimizers whose step takes no closure (a closure re-evaluates the loss, which
a pipeline step cannot): `step` keeps torch's typed signature and refuses one."""

from __future__ import annotations

from collections.abc import Callable
from typing import overload

import torch


class StepWithoutClosure(torch.optim.Optimizer):
    """`step()` runs `update()` without autograd; `step(closure)` is a ValueError."""

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        if closure is not None:
            raise ValueError(f"{type(self).__name__}.step takes no closure")
        self.update()
        return None

    def update(self) -> None:
        """The step's update of every parameter."""
        raise NotImplementedError
