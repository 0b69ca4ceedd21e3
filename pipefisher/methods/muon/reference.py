"""Muon's reference twin: the whole model in one process, with the pipeline's order of events."""

from __future__ import annotations

from torch import Tensor, nn

from pipefisher.config import RunConfig
from pipefisher.methods.interface import ReferenceCurvature
from pipefisher.methods.muon.engine import MuonEngine
from pipefisher.methods.muon.ops import first_order_globs


class ReferenceMuon(ReferenceCurvature):
    """Muon: each step's momentum and orthogonalisation from the raw gradient after the backwards
    (divided by fp16's loss scale; before clipping, which the matrices still count in), committed
    and put into `.grad` right before the optimizer step, which an fp16 overflow skips (the
    momentum then stays as it was). No refresh cycle: refresh_steps is not needed."""

    def __init__(self, config: RunConfig, model, modules: nn.Module):
        self.engine = MuonEngine(modules, config.muon, skip=first_order_globs(model))
        self._loss_scale: Tensor | None = None

    def capture(self, step: int, micro_batch: int, loss_scale: Tensor | None = None):
        self._loss_scale = loss_scale
        return super().capture(step, micro_batch, loss_scale)

    def after_step_backwards(self, step: int) -> None:
        for name in self.engine.names():
            self.engine.orthogonalise(name, self._loss_scale)

    def before_optimizer_update(self, step: int) -> None:
        self.engine.apply()
