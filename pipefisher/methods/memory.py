"""Blocks of a method's memory model of one layer (`pipefisher.planning.memory.state.CurvatureLayer`:
`name`, `state_bytes(element_bytes, keeps_results)`, `gradient_elements`, `from_linear`,
`PRECONDITIONS_BIAS`), as the built-ins' share them. Pure Python (the planner reads them without torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, TypeVar

#: bytes of one health counter (an int64 element, `pipefisher.methods.counters`)
COUNTER_ELEMENT_BYTES = 8

M = TypeVar("M", bound="MatrixLayer")


def counter_bytes(fields: int) -> int:
    """Bytes of a health-counter vector with `fields` counters (one per field of the method's health dataclass)."""
    return fields * COUNTER_ELEMENT_BYTES


def copies(keeps_results: bool) -> int:
    """Copies of a layer's refresh-sized state a rank holds: the running one, and the results in
    use when it keeps them (`keeps_results`)."""
    return 2 if keeps_results else 1


@dataclass(frozen=True)
class MatrixLayer:
    """The model of a method that preconditions a Linear layer's weight as one `rows` x `cols`
    matrix (outputs x inputs), its bias left to the first-order rule; a subclass writes `state_bytes`."""

    #: whether the method preconditions a Linear layer's bias with its weight
    PRECONDITIONS_BIAS: ClassVar[bool] = False

    name: str
    rows: int
    cols: int

    def state_bytes(self, element_bytes: int = 4, keeps_results: bool = True) -> int:
        raise NotImplementedError

    @classmethod
    def from_linear(cls: type[M], name: str, inputs: int, outputs: int, bias: bool) -> M:
        """The model of a Linear layer's weight (outputs x inputs) at the subclass's defaults."""
        return cls(name, outputs, inputs)

    @property
    def gradient_elements(self) -> int:
        """Elements of the matrix's gradient (what a gradient worker broadcasts)."""
        return self.rows * self.cols
