"""Muon's memory model of one matrix (`pipefisher.planning.memory.state.CurvatureLayer`). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pipefisher.methods.memory import MatrixLayer, copies


@dataclass(frozen=True)
class MuonLayer(MatrixLayer):
    """A Muon matrix of `rows` x `cols` elements (as `pipefisher.methods.muon.engine.MuonMatrix`)."""

    #: `MuonStep` keeps no state: the section's momentum is the engine's buffer (`state_bytes`)
    STEP_MOMENTUM: ClassVar[bool] = False

    def state_bytes(self, element_bytes: int = 4, keeps_results: bool = True) -> int:
        """The update of every step (the parameter's size, on every replica: a worker's broadcast
        lands there) and, on the replica that orthogonalises the matrix, its momentum buffer."""
        return copies(keeps_results) * self.gradient_elements * element_bytes
