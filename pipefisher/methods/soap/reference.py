"""SOAP's reference twin: the whole model in one process with the pipeline's cycle semantics."""

from __future__ import annotations

from pipefisher.methods.blocks import FACTORS
from pipefisher.methods.interface import tied_copies
from pipefisher.methods.reference import StageReference
from pipefisher.methods.soap.engine import SoapEngine
from pipefisher.methods.soap.runtime import soap_engine


class ReferenceSoap(StageReference[SoapEngine]):
    """SOAP: direction and statistics on the clipped gradient before every optimizer step; after
    a cycle's last step, the refresh from the snapshot of the cycle's start, the commit and the
    next snapshot (the pipeline computes the refresh anywhere in the cycle from the same inputs)."""

    build_engine = staticmethod(soap_engine)
    stage_skip = staticmethod(tied_copies)

    def before_optimizer_update(self, step: int) -> None:
        self.engine.precondition_all()

    def after_optimizer_step(self, step: int) -> None:
        if not self.last_of_cycle(step):
            return
        for info in self.engine.matrices():
            for factor in FACTORS:
                self.engine.refresh(info.name, factor)
        self.engine.commit()
        self.engine.snapshot()
        self.engine.check_health()
