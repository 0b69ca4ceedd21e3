"""SOAP's memory model of one matrix (`pipefisher.planning.memory.state.CurvatureLayer`). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from pipefisher.methods.blocks import FACTORS
from pipefisher.methods.memory import BlockedMatrixLayer, counter_bytes

#: bytes of one matrix's health counters (one per `pipefisher.methods.soap.health.SoapHealth` field)
COUNTER_BYTES = counter_bytes(2)
#: copies of a refreshed group of blocks (same-size blocks of one factor, stacked) a refresh holds
#: at once, in the statistics' dtype and in the working dtype (`SoapEngine.refresh`: the stacked
#: statistics, the power step's product and its sorted columns, the QR's reflectors; the bases in
#: use and the new one): measured with `LiveTensorBytes`, 5.38 float64 statistics' worth with
#: float32 bases (tests/soap/test_soap_refresh_memory.py)
REFRESH_STATISTICS_COPIES, REFRESH_BASIS_COPIES = 4, 2


@dataclass(frozen=True)
class SoapLayer(BlockedMatrixLayer):
    """A SOAP matrix ``(rows, cols)`` cut into blocks of ``block_size``; ``statistics_bytes`` per
    element of its statistics and their snapshot (float64 by default); ``deferred_statistics``:
    the fold in the next step's bubbles (``soap.fold: bubbles``), which holds a copy of the
    gradient until then; ``helpers``: the P op's rotated gradient held until the step end
    (``soap.helpers``)."""

    #: `SoapStep` keeps no state: Adam's moments are the engine's (`state_bytes`)
    STEP_MOMENTUM: ClassVar[bool] = False

    deferred_statistics: bool = False

    def state_bytes(self, element_bytes: int = 4, keeps_results: bool = True) -> int:
        """After a committed refresh, per factor: the statistic and its snapshot (``statistics_bytes``
        each) and the eigenbases in use (``element_bytes``), one n x n per block; Adam's two moments
        (``rows x cols`` each), the counters, with deferred statistics the held gradient
        (``rows x cols``, from a step's end to its fold in the next step) and with helpers the
        rotated gradient (``rows x cols``, from the P op to the step end). Every replica keeps all
        of it (`keeps_results` makes no difference: the step end needs the bases)."""
        per_factor = (2 * self.statistics_bytes + element_bytes) * self.factor_elements
        gradient_sized = 2 + int(self.deferred_statistics) + int(self.helpers)
        moments_and_held = gradient_sized * element_bytes * self.gradient_elements
        return per_factor + moments_and_held + COUNTER_BYTES

    @classmethod
    def settings_of(cls, section: Any, p_ops: bool) -> dict[str, Any]:
        """`BlockedMatrixLayer`'s settings, and `SoapConfig`'s fold (held rotations where the plan has P ops)."""
        return {**super().settings_of(section, p_ops), "deferred_statistics": section.fold == "bubbles"}

    def refresh_copy_bytes(self, element_bytes: int = 4) -> int:
        """From the matrix's first refresh op of a cycle to its commit: the pending eigenbases and
        their column orders, per factor (`pipefisher.methods.soap.state.pending_numel`)."""
        orders = sum(sum(self.info.block_sizes(f)) for f in FACTORS)
        return element_bytes * (self.factor_elements + orders)

    def refresh_work_bytes(self, element_bytes: int = 4, part: int = 0) -> int:
        """While the refresh op of factor `part` runs: the copies of its largest group of
        same-size blocks (`REFRESH_STATISTICS_COPIES`, `REFRESH_BASIS_COPIES`)."""
        return self.info.largest_group(FACTORS[part]) * (
            REFRESH_STATISTICS_COPIES * self.statistics_bytes + REFRESH_BASIS_COPIES * element_bytes
        )
