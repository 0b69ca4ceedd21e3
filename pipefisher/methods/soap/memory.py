"""SOAP's memory model of one matrix (`pipefisher.planning.memory.state.CurvatureLayer`). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipefisher.methods.blocks import FACTORS, MatrixInfo
from pipefisher.methods.memory import STATISTICS_BYTES, MatrixLayer, counter_bytes

#: bytes of one matrix's health counters (one per `pipefisher.methods.soap.health.SoapHealth` field)
COUNTER_BYTES = counter_bytes(2)
#: copies of a refreshed group of blocks (same-size blocks of one factor, stacked) a refresh holds
#: at once, in the statistics' dtype and in the working dtype (`SoapEngine.refresh`: the stacked
#: statistics, the power step's product and its sorted columns, the QR's reflectors; the bases in
#: use and the new one): measured with `LiveTensorBytes`, 5.38 float64 statistics' worth with
#: float32 bases (tests/soap/test_soap_refresh_memory.py)
REFRESH_STATISTICS_COPIES, REFRESH_BASIS_COPIES = 4, 2


@dataclass(frozen=True)
class SoapLayer(MatrixLayer):
    """A SOAP matrix ``(rows, cols)`` cut into blocks of ``block_size``; ``statistics_bytes`` per
    element of its statistics and their snapshot (float64 by default); ``deferred_statistics``:
    the fold in the next step's bubbles (``soap.fold: bubbles``), which holds a copy of the
    gradient until then; ``helpers``: the P op's rotated gradient held until the step end
    (``soap.helpers``)."""

    block_size: int = 1024
    statistics_bytes: int = 8
    deferred_statistics: bool = False
    helpers: bool = False

    def state_bytes(self, element_bytes: int = 4, keeps_results: bool = True) -> int:
        """After a committed refresh, per factor: the statistic and its snapshot (``statistics_bytes``
        each) and the eigenbases in use (``element_bytes``), one n x n per block; Adam's two moments
        (``rows x cols`` each), the counters, with deferred statistics the held gradient
        (``rows x cols``, from a step's end to its fold in the next step) and with helpers the
        rotated gradient (``rows x cols``, from the P op to the step end). Every replica keeps all
        of it (`keeps_results` makes no difference: the step end needs the bases)."""
        info = MatrixInfo.of(self.name, (self.rows, self.cols), self.block_size)
        per_factor = sum((2 * self.statistics_bytes + element_bytes) * info.statistic_numel(f) for f in FACTORS)
        gradient_sized = 2 + int(self.deferred_statistics) + int(self.helpers)
        moments_and_held = gradient_sized * element_bytes * self.gradient_elements
        return per_factor + moments_and_held + COUNTER_BYTES

    @classmethod
    def settings_of(cls, section: Any, p_ops: bool) -> dict[str, Any]:
        """`SoapConfig`'s block size, statistics dtype and fold; held rotations where the plan has P ops."""
        return {
            "block_size": section.block_size,
            "statistics_bytes": STATISTICS_BYTES[section.statistics_dtype],
            "deferred_statistics": section.fold == "bubbles",
            "helpers": p_ops,
        }

    def help_bytes(self, element_bytes: int = 4) -> int:
        """The gradient in and its rotation out, and the matrix's eigenbases in use (kept for the cycle)."""
        info = MatrixInfo.of(self.name, (self.rows, self.cols), self.block_size)
        return super().help_bytes(element_bytes) + element_bytes * sum(info.statistic_numel(f) for f in FACTORS)

    def refresh_copy_bytes(self, element_bytes: int = 4) -> int:
        """From the matrix's first refresh op of a cycle to its commit: the pending eigenbases and
        their column orders, per factor (`pipefisher.methods.soap.state.pending_numel`)."""
        info = MatrixInfo.of(self.name, (self.rows, self.cols), self.block_size)
        return element_bytes * sum(info.statistic_numel(f) + sum(info.block_sizes(f)) for f in FACTORS)

    def refresh_work_bytes(self, element_bytes: int = 4) -> int:
        """While a refresh op runs: the copies of its largest group of same-size blocks
        (`REFRESH_STATISTICS_COPIES`, `REFRESH_BASIS_COPIES`)."""
        largest = MatrixInfo.of(self.name, (self.rows, self.cols), self.block_size).largest_group()
        return largest * (REFRESH_STATISTICS_COPIES * self.statistics_bytes + REFRESH_BASIS_COPIES * element_bytes)
