"""The base of the project's optimizers: `step` keeps torch's typed signature and runs the
subclass's `update`; a closure (which re-evaluates the loss, what a pipeline step cannot) only
where the subclass takes one."""

from __future__ import annotations

from collections.abc import Callable
from typing import overload

import torch


class UpdateStep(torch.optim.Optimizer):
    """`step()` runs `update()` without autograd; `step(closure)` first evaluates the closure with
    autograd and returns its loss where `takes_closure`, else it is a ValueError."""

    takes_closure = False

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            if not self.takes_closure:
                raise ValueError(f"{type(self).__name__}.step takes no closure")
            with torch.enable_grad():
                loss = closure()
        self.update()
        return loss

    def update(self) -> None:
        """The step's update of every parameter."""
        raise NotImplementedError
