"""Shampoo's reference twin: the whole model in one process with the pipeline's cycle semantics."""

from __future__ import annotations

from pipefisher.methods.interface import tied_copies
from pipefisher.methods.reference import StageReference
from pipefisher.methods.shampoo.engine import ShampooEngine
from pipefisher.methods.shampoo.runtime import shampoo_engine


class ReferenceShampoo(StageReference[ShampooEngine]):
    """Shampoo: statistics and roots from the raw gradient of the cycle's first step (unscaled by
    fp16's loss scale), preconditioning with grafting on the clipped gradient before every SGD step."""

    build_engine = staticmethod(shampoo_engine)
    stage_skip = staticmethod(tied_copies)

    def after_step_backwards(self, step: int) -> None:
        if not self.first_of_cycle(step):
            return
        for info in self.engine.matrices():
            self.engine.capture(info.name)
            if self.loss_scale is not None:
                self.engine.captured_gradient(info.name).div_(self.loss_scale)
            for factor in ("A", "B"):
                self.engine.update_statistics(info.name, factor)
                self.engine.compute_root(info.name, factor)
            self.engine.release(info.name)

    def before_optimizer_update(self, step: int) -> None:
        self.engine.precondition_all()

    def after_optimizer_step(self, step: int) -> None:
        if self.last_of_cycle(step):
            self.engine.commit()
            self.engine.check_health()
