"""K-FAC's memory model of one layer (`pipefisher.planning.memory.CurvatureLayer`). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass

#: bytes of a K-FAC validity flag (a 0-dim bool tensor); one per running factor, one per inverse
FLAG_BYTES = 1
#: bytes of one factor's health counters (int64 vector, one per `pipefisher.methods.kfac.layer.Health` field)
COUNTER_BYTES = 3 * 8


@dataclass(frozen=True)
class KfacLayer:
    """A K-FAC layer's factor dimensions: ``a_size`` = in_features (+1 when the bias is folded
    in as a trailing ones column), ``b_size`` = out_features (as `pipefisher.methods.kfac.LayerInfo`)."""

    name: str
    a_size: int
    b_size: int

    def state_bytes(self, element_bytes: int = 4, keeps_results: bool = True) -> int:
        """Per factor of size n: the running factor (n² elements and a flag), the health counters
        and, when the rank keeps the layer's inverses, the committed inverse (n² elements and a flag)."""
        copies = 2 if keeps_results else 1
        return sum(copies * (n * n * element_bytes + FLAG_BYTES) + COUNTER_BYTES for n in (self.a_size, self.b_size))

    @property
    def gradient_elements(self) -> int:
        """(b) x (a), the bias as the last column."""
        return self.a_size * self.b_size
