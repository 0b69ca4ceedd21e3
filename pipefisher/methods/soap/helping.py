"""SOAP's help ops (`OpKind.HELP`, placed by `pipefisher.planning.packing.helpers`): a matrix's
gradient rotated into its eigenbases, ``Q_Lᵀ G Q_R`` per block, for a stage whose P op has no
bubble, done on another rank.

With `SoapConfig.helpers` a stage's P op holds each matrix's rotated gradient of the step
(`SoapEngine.hold_rotations`: linear in the gradient, so taken before clipping; the step end
scales it by the ratio of the gradient's norms). For a helped matrix the stage's rank sends, in
the cycle's first step (``help_state``), its eigenbases in use of A and B (zeros before its first
step: the stage's rank then rotates that matrix itself for the rest of the cycle, whatever comes
back, since its first bases are taken at the step end); once the stage's gradient is final,
``help_in`` its gradient as ``(rows, cols)`` in the working dtype; ``help_out`` receives the
helper's rotation into the matrix's `SoapEngine.rotation_buffer`. The helper keeps each helped
matrix's bases for the cycle (in the runtime's cycle state, so a resumption within the cycle has
them); one help op rotates (`pipefisher.methods.matrix_helping`).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from pipefisher.methods.matrix_helping import MatrixHelping
from pipefisher.methods.soap.engine import SoapEngine
from pipefisher.methods.soap.state import bases_or_zeros


@dataclass
class SoapHelping(MatrixHelping):
    """SOAP's buffers of the help collectives (`MatrixHelping`: the helper multiplies by the
    transposed left basis; the stage's rank sends its matrices' bases in use and gradients, and
    receives their rotations)."""

    section = "soap"
    left_transposed = True

    @staticmethod
    def state_of(engine: SoapEngine, names: list[str]) -> list[Tensor]:
        """The stage's rank's ``help_state`` of `names`: each matrix's eigenbases in use."""
        return [basis for name in names for basis in bases_or_zeros(engine.matrix_state(name), engine.dtype)]

    @staticmethod
    def inputs_of(engine: SoapEngine, names: list[str]) -> list[Tensor]:
        """The stage's rank's ``help_in`` of `names`: each matrix's gradient of the step."""
        return [engine.gradient_matrix(name) for name in names]

    @staticmethod
    def results_of(engine: SoapEngine, stage: int, names: list[str]) -> list[Tensor]:
        """Where the stage's rank receives the rotations of `names` (held for its step end)."""
        return [engine.rotation_buffer(name) for name in names]

    @staticmethod
    def write_results(engine: SoapEngine, stage: int, names: list[str]) -> None:
        """Nothing to write: the rotations land in the buffers the step end reads."""
