"""SOAP's reference twin: the whole model in one process with the pipeline's cycle semantics."""

from __future__ import annotations

from torch import nn

from pipefisher.config import RunConfig
from pipefisher.methods.blocks import FACTORS
from pipefisher.methods.interface import ReferenceCurvature
from pipefisher.methods.soap.engine import SoapEngine
from pipefisher.methods.interface import tied_copies


class ReferenceSoap(ReferenceCurvature):
    """SOAP: direction and statistics on the clipped gradient before every optimizer step; after
    a cycle's last step, the refresh from the snapshot of the cycle's start, the commit and the
    next snapshot (the pipeline computes the refresh anywhere in the cycle from the same inputs)."""

    def __init__(self, config: RunConfig, model, modules: nn.Module):
        super().__init__(config, model, modules)
        self.engine = SoapEngine(modules, config.soap, skip=tied_copies(model))

    def before_optimizer_update(self, step: int) -> None:
        self.engine.precondition_all()

    def after_optimizer_step(self, step: int) -> None:
        if step % self.k != self.k - 1:
            return
        for info in self.engine.matrices():
            for factor in FACTORS:
                self.engine.refresh(info.name, factor)
        self.engine.commit()
        self.engine.snapshot()
        self.engine.check_health()
