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
        row_blocks, col_blocks = split_sizes(self.rows, self.block_size), split_sizes(self.cols, self.block_size)
        squares = {
            "A": sum(r * r for r in row_blocks) * len(col_blocks),
            "B": sum(c * c for c in col_blocks) * len(row_blocks),
        }
        per_factor = sum(2 * self.statistics_bytes * squares[f] + element_bytes * squares[f] for f in FACTORS)
        gradient_sized = 2 + int(self.deferred_statistics) + int(self.helpers)
        moments_and_held = gradient_sized * element_bytes * self.gradient_elements
        return per_factor + moments_and_held + COUNTER_BYTES
