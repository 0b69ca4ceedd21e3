"""Floating-point operations of a method's tasks: the shape a task acts on, its count, and the
counting conventions every method shares. Pure Python: no torch.

A method declares its counts with a hook (`CurvatureMethod.flops`, "module:attribute" of a
`FlopHook`): given its run-file section, one matrix (`MatrixShape`) and the tokens of one
micro-batch and the sequences they form, the flops of each of its timed tasks on that matrix, keyed by
`pipefisher.core.profile.time_key` (``curvature.0``, ``refresh.1``, ``precondition``), each per
execution of the task as the profile times it (curvature per micro-batch, refresh per refresh,
precondition per step), and ``step_end``: the matrix's share of the method's work in the optimizer
step, per step (the profile times it per stage, `StageProfile.method_step_end`). Keys it leaves
out are unknown (syncs move bytes: no flops).

Conventions: a matrix product (m x k)(k x n) is 2mkn flops (one multiply and one add per term, as
`torch.utils.flop_counter` counts it); elementwise work, norms and sums (O(n²) beside O(n³)) are
not counted. Decompositions take the textbook counts of Golub & Van Loan, *Matrix Computations*
(4th ed.), for an n x n matrix: symmetric eigendecomposition with eigenvectors (`eigh`) 9n³
(tridiagonal reduction and the QR iteration accumulating the vectors, §8.3); Cholesky n³/3
(§4.2); a triangular solve with n right-hand sides n³ (§3.1); Householder QR 4n³/3 and forming its
Q explicitly another 4n³/3 (§5.2). LAPACK's divide-and-conquer `eigh` does less work than 9n³ on
large matrices, so an achieved rate from this count can read above what the hardware executed;
the count is a fixed yardstick, the same for every method and device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

#: eigh with eigenvectors, per n³
EIGH = 9.0
#: Cholesky factorisation, per n³
CHOLESKY = 1.0 / 3.0
#: triangular solve with n right-hand sides, per n³
TRIANGULAR_SOLVE = 1.0
#: Householder QR with Q formed explicitly, per n³
QR = 8.0 / 3.0


def matmul(m: int, k: int, n: int) -> float:
    """Flops of an (m x k)(k x n) product: 2mkn."""
    return 2.0 * m * k * n


@dataclass(frozen=True)
class MatrixShape:
    """A matrix a method works on: `rows` x `cols` (a linear layer's weight: rows = out_features,
    cols = in_features; another parameter: its first dimension by the product of the others),
    `has_bias` (a linear layer with a bias: K-FAC's input factor has cols + 1 rows) and `dtype`
    (the parameter's, a torch dtype name: "float32")."""

    rows: int
    cols: int
    has_bias: bool = False
    dtype: str = "float32"


@dataclass(frozen=True)
class TaskFlops:
    """The flops of one execution of a task: `matmul` (products, which a flop counter sees) and
    `decomposition` (eigh, Cholesky, QR, triangular solves by the module's conventions), and the
    `dtype` its bulk runs in (a torch dtype name)."""

    matmul: float
    decomposition: float = 0.0
    dtype: str = "float32"

    @property
    def total(self) -> float:
        return self.matmul + self.decomposition


#: (the method's run-file section, one matrix, tokens of one micro-batch, its sequences) -> time key -> flops
FlopHook = Callable[[Any, MatrixShape, int, int], Mapping[str, TaskFlops]]
