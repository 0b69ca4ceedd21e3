"""K-FAC's memory model of one layer (`pipefisher.planning.memory.state.CurvatureLayer`). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pipefisher.methods.memory import copies, counter_bytes

#: bytes of a K-FAC validity flag (a 0-dim bool tensor); one per running factor, one per inverse
FLAG_BYTES = 1
#: bytes of one factor's health counters (one per `pipefisher.methods.kfac.layer.Health` field)
COUNTER_BYTES = counter_bytes(3)


@dataclass(frozen=True)
class KfacLayer:
    """A K-FAC layer's factor dimensions: ``a_size`` = in_features (+1 when the bias is folded
    in as a trailing ones column), ``b_size`` = out_features (as `pipefisher.methods.kfac.LayerInfo`)."""

    #: whether the method preconditions a Linear layer's bias with its weight
    PRECONDITIONS_BIAS: ClassVar[bool] = True

    name: str
    a_size: int
    b_size: int

    def state_bytes(self, element_bytes: int = 4, keeps_results: bool = True) -> int:
        """Per factor of size n: the running factor (n² elements and a flag), the health counters
        and, when the rank keeps the layer's inverses, the committed inverse (n² elements and a flag)."""
        return sum(
            copies(keeps_results) * (n * n * element_bytes + FLAG_BYTES) + COUNTER_BYTES
            for n in (self.a_size, self.b_size)
        )

    @classmethod
    def from_linear(cls, name: str, inputs: int, outputs: int, bias: bool) -> KfacLayer:
        """The model of a Linear layer of `inputs` -> `outputs` features (`bias`: the rank holds its bias)."""
        return cls(name, inputs + bias, outputs)

    @property
    def gradient_elements(self) -> int:
        """(b) x (a), the bias as the last column."""
        return self.a_size * self.b_size
