"""SOAP's flops per task of a matrix (`pipefisher.methods.flops` has the conventions).

The matrix (rows, cols) is cut into blocks of `SoapConfig.block_size` (`MatrixInfo`); the refresh
of a factor's basis is, per block's n x n statistic (n = the block's rows for the left factor,
part 0; its columns for the right, part 1), one power-iteration step ``S̃ Q`` 2n³ and the QR of the
product 8n³/3, in the statistics dtype. With ``fold: bubbles`` the fold of a step's gradient into
the statistics (the U op, the profile's ``fold``) is, per block of r x c, ``G Gᵀ`` 2r²c and
``Gᵀ G`` 2c²r, in the statistics dtype. The optimizer step (``step_end``) rotates each block's
gradient into its eigenbasis and the direction back out, ``Q_Lᵀ G Q_R`` and ``Q_L N Q_Rᵀ``:
2 x (2r²c + 2rc²), in the working dtype (float32), plus the fold at ``fold: step-end`` (in the
statistics dtype, counted with the rotations); with `helpers` the rotation in is the P op's
(``precondition``) and the step end keeps the rotation out. Pure Python.
"""

from __future__ import annotations

from pipefisher.core.profile import time_key
from pipefisher.core.profile_flops import STEP_END_FLOPS
from pipefisher.methods.blocks import FACTORS, MatrixInfo
from pipefisher.methods.flops import QR, MatrixShape, TaskFlops, matmul
from pipefisher.methods.soap.method import SoapConfig


def task_flops(settings: SoapConfig, shape: MatrixShape, tokens: int, sequences: int) -> dict[str, TaskFlops]:
    """SOAP's `FlopHook`: the flops of the refresh of each factor's basis of one matrix, of its
    statistics fold where that is the U op's, and of its optimizer step (module docstring)."""
    info = MatrixInfo.of("", (shape.rows, shape.cols), settings.block_size)
    blocks = [(r, c) for r in info.row_blocks for c in info.col_blocks]
    fold = sum(matmul(r, c, r) + matmul(c, r, c) for r, c in blocks)
    rotation = sum(matmul(r, r, c) + matmul(r, c, c) for r, c in blocks)  # one way, in or out
    counts = {}
    if settings.helpers:
        counts["precondition"] = TaskFlops(rotation)
    step_end = rotation if settings.helpers else 2 * rotation
    if settings.fold == "bubbles":
        counts["fold"] = TaskFlops(fold, dtype=settings.statistics_dtype)
    else:
        step_end += fold
    counts[STEP_END_FLOPS] = TaskFlops(step_end)
    for part, factor in enumerate(FACTORS):
        sizes = info.block_sizes(factor)
        counts[time_key("refresh", part)] = TaskFlops(
            sum(matmul(n, n, n) for n in sizes), sum(QR * n**3 for n in sizes), settings.statistics_dtype
        )
    return counts
