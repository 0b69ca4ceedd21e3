"""Shampoo's help ops (`OpKind.HELP`, placed by `pipefisher.planning.packing.helpers`): a
matrix's products ``L^(-1/4) G R^(-1/4)`` of a stage whose P op has no bubble, done on another rank.

With `ShampooConfig.helpers` a stage's P op holds each matrix's products of the step's gradient
(`ShampooEngine.hold_products`: linear in the gradient, so taken before clipping; the step end's
norm transfer and the grafting where a root is not ok read them). For a helped matrix the stage's
rank sends, in the cycle's first step (``help_state``), its committed roots of A and B (zeros
before the first commit: its step end then takes the grafting direction whatever comes back);
once the stage's gradient is final, ``help_in`` its gradient as ``(rows, cols)`` in the working
dtype; ``help_out`` receives the helper's products into the matrix's product buffer
(`ShampooEngine.product_buffer`). The helper keeps each helped matrix's roots for the cycle (in
the runtime's cycle state, so a resumption within the cycle has them); one help op multiplies
(`pipefisher.methods.matrix_helping`).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from pipefisher.methods.matrix_helping import MatrixHelping
from pipefisher.methods.shampoo.engine import ShampooEngine
from pipefisher.methods.shampoo.state import gradient_matrix, roots_or_zeros


@dataclass
class ShampooHelping(MatrixHelping):
    """Shampoo's buffers of the help collectives (`MatrixHelping`; the stage's rank sends its
    matrices' roots in use and gradients, and receives their products)."""

    section = "shampoo"

    @staticmethod
    def state_of(engine: ShampooEngine, names: list[str]) -> list[Tensor]:
        """The stage's rank's ``help_state`` of `names`: each matrix's roots of A and B in use."""
        return [root for name in names for root in roots_or_zeros(engine.matrix_state(name), engine.dtype)]

    @staticmethod
    def inputs_of(engine: ShampooEngine, names: list[str]) -> list[Tensor]:
        """The stage's rank's ``help_in`` of `names`: each matrix's gradient of the step."""
        return [gradient_matrix(engine.matrix_state(name), engine.dtype) for name in names]

    @staticmethod
    def results_of(engine: ShampooEngine, stage: int, names: list[str]) -> list[Tensor]:
        """Where the stage's rank receives the products of `names` (held for its step end)."""
        return [engine.product_buffer(name) for name in names]

    @staticmethod
    def write_results(engine: ShampooEngine, stage: int, names: list[str]) -> None:
        """Nothing to write: the products land in the buffers the step end reads."""
