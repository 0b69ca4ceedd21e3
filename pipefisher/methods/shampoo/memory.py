"""Shampoo's memory model of one matrix (`pipefisher.planning.memory.state.CurvatureLayer`). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipefisher.methods.blocks import FACTORS
from pipefisher.methods.memory import BlockedMatrixLayer, copies, counter_bytes

#: bytes of one factor's health counters (one per `pipefisher.methods.shampoo.health.ShampooHealth` field)
COUNTER_BYTES = counter_bytes(2)
#: bytes of one block's root flag (a bool)
FLAG_BYTES = 1
#: copies of a root op's group of blocks beside the stacked statistics (`refresh_work_bytes`):
#: float64 ones by eigendecomposition, ones in the statistics' dtype by Newton's iteration
EIGEN_FLOAT64_COPIES, NEWTON_STATISTICS_COPIES = 3, 9


@dataclass(frozen=True)
class ShampooLayer(BlockedMatrixLayer):
    """A Shampoo matrix ``(rows, cols)`` cut into blocks of ``block_size``; ``statistics_bytes``
    per element of its statistics (float64 by default); ``adam_grafting``: Adam grafting's second
    moment (``grafting: adam``, the default); ``helpers``: the P op's products held until the
    step end (``shampoo.helpers``)."""

    adam_grafting: bool = True
    newton_root: bool = False

    def state_bytes(self, element_bytes: int = 4, keeps_results: bool = True) -> int:
        """At a cycle's peak, per factor: the statistic (``statistics_bytes``), the roots in use
        and, when it keeps results (`copies`), the cycle's pending ones (``element_bytes``, one n x n
        per block, with a flag per block), the counters; the gradient captured in the cycle's first
        step (``rows x cols``, until both statistics fold it), Adam grafting's second moment and the
        held products (``rows x cols`` each, where on)."""
        flags = FLAG_BYTES * self.info.num_blocks * len(FACTORS)
        roots = copies(keeps_results) * (element_bytes * self.factor_elements + flags)
        statistics = self.statistics_bytes * self.factor_elements + COUNTER_BYTES * len(FACTORS)
        gradient_sized = 1 + int(self.adam_grafting) + int(self.helpers)
        return statistics + roots + gradient_sized * element_bytes * self.gradient_elements

    @classmethod
    def settings_of(cls, section: Any, p_ops: bool) -> dict[str, Any]:
        """`BlockedMatrixLayer`'s settings (held products where the plan has P ops), and
        `ShampooConfig`'s grafting and root method."""
        return {
            **super().settings_of(section, p_ops),
            "adam_grafting": section.grafting == "adam",
            "newton_root": section.root == "newton",
        }

    def refresh_work_bytes(self, element_bytes: int = 4, part: int = 0) -> int:
        """While the root op of factor `part` runs, per element of its largest group of same-size blocks: by
        eigendecomposition the stacked statistics and 3 float64 copies (the eigenvectors, them
        scaled, the root), by Newton's iteration 9 copies in the statistics' dtype (the stacked
        ones among them) and a root in the working dtype (`pipefisher.methods.shampoo.roots`;
        measured with `LiveTensorBytes`, tests/shampoo/test_shampoo_roots_memory.py)."""
        largest = self.info.largest_group(FACTORS[part])
        if self.newton_root:
            return largest * (NEWTON_STATISTICS_COPIES * self.statistics_bytes + element_bytes)
        return largest * (self.statistics_bytes + EIGEN_FLOAT64_COPIES * 8)
