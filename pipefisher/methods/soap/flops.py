"""SOAP's flops per task of a matrix (`pipefisher.methods.flops` has the conventions).

The matrix (rows, cols) is cut into blocks of `SoapConfig.block_size` (`MatrixInfo`); the refresh
of a factor's basis is, per block's n x n statistic (n = the block's rows for the left factor,
part 0; its columns for the right, part 1), one power-iteration step ``S̃ Q`` 2n³ and the QR of the
product 8n³/3, in the statistics dtype. With ``fold: bubbles`` the fold of a step's gradient into
the statistics (the U op, the profile's ``precondition``) is, per block of r x c, ``G Gᵀ`` 2r²c and
``Gᵀ G`` 2c²r, in the statistics dtype. The per-step rotations (and the fold at ``fold: step-end``)
run in the optimizer step (the profile's step end), not counted here. Pure Python.
"""

from __future__ import annotations

from pipefisher.core.profile import time_key
from pipefisher.methods.blocks import FACTORS, MatrixInfo
from pipefisher.methods.flops import QR, MatrixShape, TaskFlops, matmul
from pipefisher.methods.soap.method import SoapConfig


def task_flops(settings: SoapConfig, shape: MatrixShape, tokens: int) -> dict[str, TaskFlops]:
    """SOAP's `FlopHook`: the flops of the refresh of each factor's basis of one matrix, and of
    its statistics fold where that is the U op's (module docstring)."""
    info = MatrixInfo.of("", (shape.rows, shape.cols), settings.block_size)
    counts = {}
    if settings.fold == "bubbles":
        fold = sum(matmul(r, c, r) + matmul(c, r, c) for r in info.row_blocks for c in info.col_blocks)
        counts["precondition"] = TaskFlops(fold, dtype=settings.statistics_dtype)
    for part, factor in enumerate(FACTORS):
        sizes = info.block_sizes(factor)
        counts[time_key("refresh", part)] = TaskFlops(
            sum(matmul(n, n, n) for n in sizes), sum(QR * n**3 for n in sizes), settings.statistics_dtype
        )
    return counts
