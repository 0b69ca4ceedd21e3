"""Shampoo's flops per task of a matrix (`pipefisher.methods.flops` has the conventions).

The matrix (rows, cols) is cut into blocks of `ShampooConfig.block_size` (`MatrixInfo`); its
refresh of the left factor (part 0) is, per block (r x c), the statistic ``G Gᵀ`` 2·r²·c and the
inverse 4th root of the r x r statistic; of the right factor (part 1) ``Gᵀ G`` 2·c²·r and the root
of c x c. A root of n x n: eigen = eigh 9n³ + the product ``(V s) Vᵀ`` 2n³, in float64 (the root
is computed in float64 whatever the statistics dtype); newton = `NEWTON_ITERATIONS` steps of
``X Mₚ``, ``Mₚ⁴`` (two squarings) and ``Mₚ⁴ M``, 8n³ each, in the statistics dtype. The
optimizer step (``step_end``) preconditions each block, ``L^(-1/4) G R^(-1/4)``: 2r²c + 2rc², in
the working dtype (float32); with `helpers` these products are the P op's (``precondition``);
grafting is elementwise (not counted). Pure Python.
"""

from __future__ import annotations

from pipefisher.core.profile import time_key
from pipefisher.core.profile_flops import STEP_END_FLOPS
from pipefisher.methods.blocks import MatrixInfo
from pipefisher.methods.flops import EIGH, MatrixShape, TaskFlops, matmul
from pipefisher.methods.shampoo.method import ShampooConfig

#: the Newton iteration runs this many steps on every matrix (`pipefisher.methods.shampoo.roots`)
NEWTON_ITERATIONS = 100
#: matrix products of one Newton step: X Mₚ, two squarings for Mₚ⁴, Mₚ⁴ M
NEWTON_PRODUCTS = 4


def root_flops(n: int, settings: ShampooConfig) -> tuple[float, float]:
    """(matmul, decomposition) flops of the inverse 4th root of one n x n statistic."""
    if settings.root == "eigen":
        return matmul(n, n, n), EIGH * n**3
    return NEWTON_ITERATIONS * NEWTON_PRODUCTS * matmul(n, n, n), 0.0


def task_flops(settings: ShampooConfig, shape: MatrixShape, tokens: int, sequences: int) -> dict[str, TaskFlops]:
    """Shampoo's `FlopHook`: the flops of the refresh of each factor of one matrix and of its
    optimizer step (module docstring)."""
    info = MatrixInfo.of("", (shape.rows, shape.cols), settings.block_size)
    dtype = "float64" if settings.root == "eigen" else settings.statistics_dtype
    counts = {}
    for part, (sides, others) in enumerate(((info.row_blocks, info.col_blocks), (info.col_blocks, info.row_blocks))):
        products, decompositions = 0.0, 0.0
        for n in sides:
            for other in others:
                root = root_flops(n, settings)
                products += matmul(n, other, n) + root[0]
                decompositions += root[1]
        counts[time_key("refresh", part)] = TaskFlops(products, decompositions, dtype)
    step = sum(matmul(r, r, c) + matmul(r, c, c) for r in info.row_blocks for c in info.col_blocks)
    counts["precondition" if settings.helpers else STEP_END_FLOPS] = TaskFlops(step)
    return counts
