"""K-FAC's reference twin: the whole model in one process with the pipeline's cycle semantics."""

from __future__ import annotations

from contextlib import nullcontext

from torch import nn

from pipefisher.config import RunConfig
from pipefisher.methods.interface import ReferenceCurvature
from pipefisher.methods.kfac.ops import kfac_engine


class ReferenceKfac(ReferenceCurvature):
    """K-FAC: capture in the cycle's first step, preconditioning every step (before the tied sum
    and clipping, as the pipeline's precondition ops)."""

    def __init__(self, config: RunConfig, model, modules: nn.Module):
        super().__init__(config, model, modules)
        self.lr = config.optimizer_settings.lr
        skip = model.first_order_linears()
        self.engine = kfac_engine(config, modules, [f"*.{p}" for p in skip])

    def capture(self, step: int, micro_batch: int, loss_scale=None):
        return self.engine.capture(micro_batch, loss_scale=loss_scale) if step % self.k == 0 else nullcontext()

    def after_step_backwards(self, step: int) -> None:
        if step % self.k == 0:
            for info in self.engine.layers():
                for factor in ("A", "B"):
                    for micro_batch in self.engine.captured(info.name, factor):
                        self.engine.curvature(info.name, factor, micro_batch)
                    self.engine.invert(info.name, factor)
        self.engine.precondition_all(self.lr)

    def after_optimizer_step(self, step: int) -> None:
        if step % self.k == self.k - 1:
            for info in self.engine.layers():
                self.engine.commit(info.name)
