"""Shampoo's memory model of one matrix (`pipefisher.planning.memory.state.CurvatureLayer`). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipefisher.methods.blocks import FACTORS, MatrixInfo
from pipefisher.methods.memory import STATISTICS_BYTES, MatrixLayer, copies, counter_bytes

#: bytes of one factor's health counters (one per `pipefisher.methods.shampoo.health.ShampooHealth` field)
COUNTER_BYTES = counter_bytes(2)
#: bytes of one block's root flag (a bool)
FLAG_BYTES = 1
#: copies of a root op's group of blocks beside the stacked statistics (`refresh_work_bytes`):
#: float64 ones by eigendecomposition, ones in the statistics' dtype by Newton's iteration
EIGEN_FLOAT64_COPIES, NEWTON_STATISTICS_COPIES = 3, 9


@dataclass(frozen=True)
class ShampooLayer(MatrixLayer):
    """A Shampoo matrix ``(rows, cols)`` cut into blocks of ``block_size``; ``statistics_bytes``
    per element of its statistics (float64 by default); ``adam_grafting``: Adam grafting's second
    moment (``grafting: adam``, the default); ``helpers``: the P op's products held until the
    step end (``shampoo.helpers``)."""

    block_size: int = 1024
    statistics_bytes: int = 8
    adam_grafting: bool = True
    helpers: bool = False
    newton_root: bool = False

    def state_bytes(self, element_bytes: int = 4, keeps_results: bool = True) -> int:
        """At a cycle's peak, per factor: the statistic (``statistics_bytes``), the roots in use
        and, when it keeps results (`copies`), the cycle's pending ones (``element_bytes``, one n x n
        per block, with a flag per block), the counters; the gradient captured in the cycle's first
        step (``rows x cols``, until both statistics fold it), Adam grafting's second moment and the
        held products (``rows x cols`` each, where on)."""
        info = MatrixInfo.of(self.name, (self.rows, self.cols), self.block_size)
        roots = copies(keeps_results) * sum(
            element_bytes * info.statistic_numel(f) + FLAG_BYTES * info.num_blocks for f in FACTORS
        )
        statistics = sum(self.statistics_bytes * info.statistic_numel(f) + COUNTER_BYTES for f in FACTORS)
        gradient_sized = 1 + int(self.adam_grafting) + int(self.helpers)
        return statistics + roots + gradient_sized * element_bytes * self.gradient_elements

    @classmethod
    def settings_of(cls, section: Any, p_ops: bool) -> dict[str, Any]:
        """`ShampooConfig`'s block size, statistics dtype and grafting; held products where the plan has P ops."""
        return {
            "block_size": section.block_size,
            "statistics_bytes": STATISTICS_BYTES[section.statistics_dtype],
            "adam_grafting": section.grafting == "adam",
            "helpers": p_ops,
            "newton_root": section.root == "newton",
        }

    def refresh_work_bytes(self, element_bytes: int = 4) -> int:
        """While a root op runs, per element of its largest group of same-size blocks: by
        eigendecomposition the stacked statistics and 3 float64 copies (the eigenvectors, them
        scaled, the root), by Newton's iteration 9 copies in the statistics' dtype (the stacked
        ones among them) and a root in the working dtype (`pipefisher.methods.shampoo.roots`;
        measured with `LiveTensorBytes`, tests/shampoo/test_shampoo_roots_memory.py)."""
        largest = MatrixInfo.of(self.name, (self.rows, self.cols), self.block_size).largest_group()
        if self.newton_root:
            return largest * (NEWTON_STATISTICS_COPIES * self.statistics_bytes + element_bytes)
        return largest * (self.statistics_bytes + EIGEN_FLOAT64_COPIES * 8)

    def help_bytes(self, element_bytes: int = 4) -> int:
        """The gradient in and its products out, and the matrix's roots in use (kept for the cycle)."""
        info = MatrixInfo.of(self.name, (self.rows, self.cols), self.block_size)
        return super().help_bytes(element_bytes) + element_bytes * sum(info.statistic_numel(f) for f in FACTORS)
