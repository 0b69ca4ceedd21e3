"""Muon's memory model of one matrix (`pipefisher.planning.memory.state.CurvatureLayer`). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class MuonLayer:
    """A Muon matrix of `rows` x `cols` elements (as `pipefisher.methods.muon.engine.MuonMatrix`)."""

    #: whether the method preconditions a Linear layer's bias with its weight
    PRECONDITIONS_BIAS: ClassVar[bool] = False

    name: str
    rows: int
    cols: int

    def state_bytes(self, element_bytes: int = 4, keeps_results: bool = True) -> int:
        """The update of every step (the parameter's size, on every replica: a worker's broadcast
        lands there) and, on the replica that orthogonalises the matrix, its momentum buffer."""
        return (2 if keeps_results else 1) * self.gradient_elements * element_bytes

    @classmethod
    def from_linear(cls, name: str, inputs: int, outputs: int, bias: bool) -> MuonLayer:
        """The model of a Linear layer's weight (outputs x inputs; Muon leaves the bias to the first-order rule)."""
        return cls(name, outputs, inputs)

    @property
    def gradient_elements(self) -> int:
        """Elements of the update a worker broadcasts."""
        return self.rows * self.cols
