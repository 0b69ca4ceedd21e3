"""SOAP's memory model of one matrix (`pipefisher.planning.memory.state.CurvatureLayer`). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass

from pipefisher.methods.blocks import FACTORS, split_sizes
from pipefisher.methods.memory import MatrixLayer, counter_bytes

#: bytes of one matrix's health counters (one per `pipefisher.methods.soap.health.SoapHealth` field)
COUNTER_BYTES = counter_bytes(2)


@dataclass(frozen=True)
class SoapLayer(MatrixLayer):
    """A SOAP matrix ``(rows, cols)`` cut into blocks of ``block_size``; ``statistics_bytes`` per
    element of its statistics and their snapshot (float64 by default); ``deferred_statistics``:
    the fold in the next step's bubbles (``soap.fold: bubbles``), which holds a copy of the
    gradient until then."""

    block_size: int = 1024
    statistics_bytes: int = 8
    deferred_statistics: bool = False

    def state_bytes(self, element_bytes: int = 4, keeps_results: bool = True) -> int:
        """After a committed refresh, per factor: the statistic and its snapshot (``statistics_bytes``
        each) and the eigenbases in use (``element_bytes``), one n x n per block; Adam's two moments
        (``rows x cols`` each), the counters, and with deferred statistics the held gradient
        (``rows x cols``, from a step's end to its fold in the next step). Every replica keeps all
        of it (`keeps_results` makes no difference: the step end needs the bases)."""
        row_blocks, col_blocks = split_sizes(self.rows, self.block_size), split_sizes(self.cols, self.block_size)
        squares = {
            "A": sum(r * r for r in row_blocks) * len(col_blocks),
            "B": sum(c * c for c in col_blocks) * len(row_blocks),
        }
        per_factor = sum(2 * self.statistics_bytes * squares[f] + element_bytes * squares[f] for f in FACTORS)
        moments_and_held = (3 if self.deferred_statistics else 2) * element_bytes * self.gradient_elements
        return per_factor + moments_and_held + COUNTER_BYTES
