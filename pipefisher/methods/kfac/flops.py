"""K-FAC's flops per task of a linear layer (`pipefisher.methods.flops` has the conventions).

With d_in = cols, d_out = rows, a = d_in + 1 with a bias (d_in without) and t rows (tokens) of a
micro-batch (its sequences with ``approximation: reduce``): curvature of the input factor ``xᵀx``
2·t·d_in² and of the output-gradient factor 2·t·d_out² per micro-batch (the bias column's sums are not counted); the refresh of an n x n factor
(n = a, d_out) by `KfacConfig.inverse`: eigen = eigh 9n³ + the product ``(Q / d) Qᵀ`` 2n³,
cholesky = Cholesky n³/3 + the triangular inverse n³ + ``L⁻ᵀ L⁻¹`` 2n³; the precondition
``B⁻¹ G A⁻¹`` 2·d_out²·a + 2·d_out·a² per step. All in the factor dtype (float32, float64 for
float64 parameters). Pure Python.
"""

from __future__ import annotations

from pipefisher.core.profile import time_key
from pipefisher.methods.flops import CHOLESKY, EIGH, TRIANGULAR_SOLVE, MatrixShape, TaskFlops, matmul
from pipefisher.methods.kfac.method import KfacConfig


def factor_dtype(dtype: str) -> str:
    """The dtype K-FAC keeps the factors of a layer with parameters of `dtype` in: float32 or wider."""
    return "float64" if dtype == "float64" else "float32"


def inverse_flops(n: int, inverse: str, dtype: str) -> TaskFlops:
    """The refresh (damped inverse) of an n x n factor by `inverse` ("eigen", "cholesky")."""
    if inverse == "eigen":
        return TaskFlops(matmul(n, n, n), EIGH * n**3, dtype)
    return TaskFlops(matmul(n, n, n), (CHOLESKY + TRIANGULAR_SOLVE) * n**3, dtype)


def task_flops(settings: KfacConfig, shape: MatrixShape, tokens: int, sequences: int) -> dict[str, TaskFlops]:
    """K-FAC's `FlopHook`: the flops of each task of one linear layer (module docstring)."""
    dtype = factor_dtype(shape.dtype)
    a, b = shape.cols + int(shape.has_bias), shape.rows
    rows = sequences if settings.approximation == "reduce" else tokens
    return {
        time_key("curvature", 0): TaskFlops(matmul(shape.cols, rows, shape.cols), dtype=dtype),
        time_key("curvature", 1): TaskFlops(matmul(b, rows, b), dtype=dtype),
        time_key("refresh", 0): inverse_flops(a, settings.inverse, dtype),
        time_key("refresh", 1): inverse_flops(b, settings.inverse, dtype),
        "precondition": TaskFlops(matmul(b, b, a) + matmul(b, a, a), dtype=dtype),
    }
