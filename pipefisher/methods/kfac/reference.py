"""K-FAC's reference twin: the whole model in one process with the pipeline's cycle semantics."""

from __future__ import annotations

from contextlib import AbstractContextManager

from torch import Tensor

from pipefisher.methods.kfac.engine import KFACEngine
from pipefisher.methods.kfac.runtime import kfac_engine
from pipefisher.methods.reference import StageReference


class ReferenceKfac(StageReference[KFACEngine]):
    """K-FAC: capture in the cycle's first step, preconditioning every step (before the tied sum
    and clipping, as the pipeline's precondition ops)."""

    build_engine = staticmethod(kfac_engine)

    def capture_context(self, micro_batch: int, loss_scale: Tensor | None) -> AbstractContextManager:
        return self.engine.capture(micro_batch, loss_scale=loss_scale)

    def after_step_backwards(self, step: int) -> None:
        if self.first_of_cycle(step):
            for info in self.engine.layers():
                for factor in ("A", "B"):
                    for micro_batch in self.engine.captured(info.name, factor):
                        self.engine.curvature(info.name, factor, micro_batch)
                    self.engine.invert(info.name, factor)
        self.engine.precondition_all(self.config.lr)

    def after_optimizer_step(self, step: int) -> None:
        if self.last_of_cycle(step):
            for info in self.engine.layers():
                self.engine.commit(info.name)
