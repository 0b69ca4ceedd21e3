"""Muon's memory model of one matrix (`pipefisher.planning.memory.CurvatureLayer`). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MuonLayer:
    """A Muon matrix of `rows` x `cols` elements (as `pipefisher.methods.muon.engine.MuonMatrix`)."""

    name: str
    rows: int
    cols: int

    def state_bytes(self, element_bytes: int = 4, keeps_results: bool = True) -> int:
        """The update of every step (the parameter's size, on every replica: a worker's broadcast
        lands there) and, on the replica that orthogonalises the matrix, its momentum buffer."""
        return (2 if keeps_results else 1) * self.gradient_elements * element_bytes

    @property
    def gradient_elements(self) -> int:
        """Elements of the update a worker broadcasts."""
        return self.rows * self.cols
