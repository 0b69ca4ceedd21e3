"""K-FAC's memory model of one layer (`pipefisher.planning.memory.state.CurvatureLayer`). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from pipefisher.methods.memory import copies, counter_bytes

#: bytes of a K-FAC validity flag (a 0-dim bool tensor); one per running factor, one per inverse
FLAG_BYTES = 1
#: bytes of one factor's health counters (one per `pipefisher.methods.kfac.layer.Health` field)
COUNTER_BYTES = counter_bytes(3)
#: copies of a factor an inversion holds beside the layer's state and refresh copy, by
#: `KfacConfig.inverse` (`pipefisher.methods.kfac.factors`; measured with `LiveTensorBytes`,
#: tests/kfac/test_kfac_inverse_memory.py)
INVERSE_WORK_COPIES = {"eigen": 2, "cholesky": 3}


@dataclass(frozen=True)
class KfacLayer:
    """A K-FAC layer's factor dimensions: ``a_size`` = in_features (+1 when the bias is folded
    in as a trailing ones column), ``b_size`` = out_features (as `pipefisher.methods.kfac.LayerInfo`)."""

    #: whether the method preconditions a Linear layer's bias with its weight
    PRECONDITIONS_BIAS: ClassVar[bool] = True
    #: K-FAC steps with SGD at the section's momentum: a buffer per preconditioned parameter
    STEP_MOMENTUM: ClassVar[bool] = True

    name: str
    a_size: int
    b_size: int
    #: the section's `KfacConfig.inverse`
    inverse: str = "eigen"

    def state_bytes(self, element_bytes: int = 4, keeps_results: bool = True) -> int:
        """Per factor of size n: the running factor (n² elements and a flag), the health counters
        and, when the rank keeps the layer's inverses, the committed inverse (n² elements and a flag)."""
        return sum(
            copies(keeps_results) * (n * n * element_bytes + FLAG_BYTES) + COUNTER_BYTES
            for n in (self.a_size, self.b_size)
        )

    @classmethod
    def from_linear(cls, name: str, inputs: int, outputs: int, bias: bool, **settings: Any) -> KfacLayer:
        """The model of a Linear layer of `inputs` -> `outputs` features (`bias`: the rank holds its
        bias) at `settings` (`settings_of`'s)."""
        return cls(name, inputs + bias, outputs, **settings)

    @classmethod
    def settings_of(cls, section: Any, p_ops: bool) -> dict[str, Any]:
        """The section's inverse method (its inversion's temporaries)."""
        return {"inverse": section.inverse}

    def refresh_copy_bytes(self, element_bytes: int = 4) -> int:
        """From the layer's first curvature task of a cycle to its commit: the factors being built,
        then the pending inverses (`state_bytes` without the results)."""
        return self.state_bytes(element_bytes, False)

    def refresh_work_bytes(self, element_bytes: int = 4, part: int = 0) -> int:
        """While the inversion of factor `part` (0: A, 1: B) runs, its temporaries beside the
        state and the refresh copy: `INVERSE_WORK_COPIES` of the factor (by eigendecomposition,
        at its last product: the eigenvectors, their scaled copy and the inverse, less the built
        factor freed first)."""
        return INVERSE_WORK_COPIES[self.inverse] * (self.a_size, self.b_size)[part] ** 2 * element_bytes

    def help_bytes(self, element_bytes: int = 4) -> int:
        """What a rank that preconditions the layer for another holds (`HelpedLayer`): its
        committed inverses with their flags, the gradient matrix in and the result out."""
        inverses = sum(n * n * element_bytes + FLAG_BYTES for n in (self.a_size, self.b_size))
        return inverses + 2 * self.gradient_elements * element_bytes

    def help_result_bytes(self, element_bytes: int = 4) -> int:
        """What the layer's own rank holds while another helps: the buffer the result lands in."""
        return self.gradient_elements * element_bytes

    @property
    def gradient_elements(self) -> int:
        """(b) x (a), the bias as the last column."""
        return self.a_size * self.b_size
