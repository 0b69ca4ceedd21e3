"""Muon's flops per task of a matrix (`pipefisher.methods.flops` has the conventions).

Its one task, the orthogonalisation of a (rows, cols) matrix (the profile's ``precondition``, per
step), is `MuonConfig.ns_steps` quintic Newton–Schulz steps on X of m x n (m = min(rows, cols),
n = max): ``A = X Xᵀ`` 2m²n, ``b A + c A²`` 2m³, ``a X + (…) X`` 2m²n; in `MuonConfig.ns_dtype`.
The momentum step and the norm (O(mn)) are not counted. Pure Python.
"""

from __future__ import annotations

from pipefisher.methods.flops import MatrixShape, TaskFlops, matmul
from pipefisher.methods.muon.method import MuonConfig


def task_flops(settings: MuonConfig, shape: MatrixShape, tokens: int, sequences: int) -> dict[str, TaskFlops]:
    """Muon's `FlopHook`: the flops of the orthogonalisation of one matrix (module docstring)."""
    m, n = sorted((shape.rows, shape.cols))
    step = matmul(m, n, m) + matmul(m, m, m) + matmul(m, m, n)
    return {"precondition": TaskFlops(settings.ns_steps * step, dtype=settings.ns_dtype)}
