"""Shampoo's reference twin: the whole model in one process with the pipeline's cycle semantics."""

from __future__ import annotations

from contextlib import nullcontext

from torch import nn

from pipefisher.config import RunConfig
from pipefisher.methods.interface import ReferenceCurvature
from pipefisher.methods.interface import tied_copies
from pipefisher.methods.shampoo.ops import shampoo_engine


class ReferenceShampoo(ReferenceCurvature):
    """Shampoo: statistics and roots from the raw gradient of the cycle's first step (unscaled by
    fp16's loss scale), preconditioning with grafting on the clipped gradient before every SGD step."""

    def __init__(self, config: RunConfig, model, modules: nn.Module):
        super().__init__(config, model, modules)
        self.engine = shampoo_engine(config, modules, tied_copies(model))
        self._loss_scale = None

    def capture(self, step: int, micro_batch: int, loss_scale=None):
        self._loss_scale = loss_scale
        return nullcontext()

    def after_step_backwards(self, step: int) -> None:
        if step % self.k:
            return
        for info in self.engine.matrices():
            self.engine.capture(info.name)
            if self._loss_scale is not None:
                self.engine.captured_gradient(info.name).div_(self._loss_scale)
            for factor in ("A", "B"):
                self.engine.update_statistics(info.name, factor)
                self.engine.compute_root(info.name, factor)
            self.engine.release(info.name)

    def before_optimizer_update(self, step: int) -> None:
        self.engine.precondition_all()

    def after_optimizer_step(self, step: int) -> None:
        if step % self.k == self.k - 1:
            self.engine.commit()
            self.engine.check_health()
