"""Blocks of a method's memory model of one layer
(`pipefisher.planning.memory.layer_model.CurvatureLayer`, with `from_linear`, `settings_of` and
`PRECONDITIONS_BIAS`), as the built-ins share them. Pure Python (the planner reads them without
torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from pipefisher.methods.blocks import FACTORS, MatrixInfo

#: bytes of one health counter (an int64 element, `pipefisher.methods.counters`)
COUNTER_ELEMENT_BYTES = 8
#: bytes per element of each `pipefisher.methods.settings.StatisticsDtype`
STATISTICS_BYTES = {"float64": 8, "float32": 4}

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
    #: whether the method's optimizer step keeps a momentum buffer per parameter it preconditions
    #: (an SGD step at the section's momentum; `step_momentum`)
    STEP_MOMENTUM: ClassVar[bool] = True

    name: str
    rows: int
    cols: int

    def state_bytes(self, element_bytes: int = 4, keeps_results: bool = True) -> int:
        raise NotImplementedError

    @classmethod
    def from_linear(cls: type[M], name: str, inputs: int, outputs: int, bias: bool, **settings: Any) -> M:
        """The model of a Linear layer's weight (outputs x inputs) at the subclass's defaults, or
        at `settings` (its fields, as `settings_of` gives them)."""
        return cls(name, outputs, inputs, **settings)

    @classmethod
    def settings_of(cls, section: Any, p_ops: bool) -> dict[str, Any]:
        """The fields of this model that a run's method section (its `RefreshConfig`) sets;
        `p_ops`: whether the run's plan has the method's per-step P ops. None by default."""
        return {}

    def refresh_copy_bytes(self, element_bytes: int = 4) -> int:
        """Bytes held beside `state_bytes` from the matrix's first refresh op of a cycle to its
        commit: none by default."""
        return 0

    def refresh_work_bytes(self, element_bytes: int = 4, part: int = 0) -> int:
        """Bytes the refresh op of the matrix's `part` allocates while it runs: none by default."""
        return 0

    def help_bytes(self, element_bytes: int = 4) -> int:
        """Bytes a rank that helps with the matrix (its help op) holds for it: the gradient it
        receives and the result it sends back, `element_bytes` each."""
        return 2 * self.gradient_elements * element_bytes

    def help_result_bytes(self, element_bytes: int = 4) -> int:
        """What the matrix's own rank holds beside its state while another helps: nothing by
        default (the result lands in a buffer `state_bytes` counts)."""
        return 0

    @property
    def gradient_elements(self) -> int:
        """Elements of the matrix's gradient (what a gradient worker broadcasts)."""
        return self.rows * self.cols


@dataclass(frozen=True)
class BlockedMatrixLayer(MatrixLayer):
    """A matrix whose two factors' statistics are cut into blocks of ``block_size`` (SOAP's,
    Shampoo's): ``statistics_bytes`` per element of them; ``helpers``: its P op's result (a
    gradient-sized tensor) held until the step end, where the plan has P ops."""

    block_size: int = 1024
    statistics_bytes: int = 8
    helpers: bool = False

    @property
    def info(self) -> MatrixInfo:
        """The matrix's block structure."""
        return MatrixInfo.of(self.name, (self.rows, self.cols), self.block_size)

    @property
    def factor_elements(self) -> int:
        """Elements of both factors' block matrices (statistics, bases, roots) together."""
        return sum(self.info.statistic_numel(f) for f in FACTORS)

    @classmethod
    def settings_of(cls, section: Any, p_ops: bool) -> dict[str, Any]:
        """The section's block size and statistics dtype; the held result where the plan has P ops."""
        return {
            "block_size": section.block_size,
            "statistics_bytes": STATISTICS_BYTES[section.statistics_dtype],
            "helpers": p_ops,
        }

    def help_bytes(self, element_bytes: int = 4) -> int:
        """The gradient in and the result out, and the refresh results the helper applies (one
        n x n per block and factor, kept for the cycle)."""
        return super().help_bytes(element_bytes) + element_bytes * self.factor_elements
