"""Muon's reference twin: the whole model in one process, with the pipeline's order of events."""

from __future__ import annotations

from pipefisher.methods.muon.engine import MuonEngine
from pipefisher.methods.muon.runtime import first_order_globs, muon_engine
from pipefisher.methods.reference import StageReference


class ReferenceMuon(StageReference[MuonEngine]):
    """Muon: each step's momentum and orthogonalisation from the raw gradient after the backwards
    (divided by fp16's loss scale; before clipping, which the matrices still count in), committed
    and put into `.grad` right before the optimizer step, which an fp16 overflow skips (the
    momentum then stays as it was). No refresh cycle: refresh_steps is not needed."""

    refreshes = False
    build_engine = staticmethod(muon_engine)
    stage_skip = staticmethod(first_order_globs)

    def after_step_backwards(self, step: int) -> None:
        self.engine.orthogonalise(self.engine.names(), self.loss_scale)

    def before_optimizer_update(self, step: int) -> None:
        self.engine.apply()
