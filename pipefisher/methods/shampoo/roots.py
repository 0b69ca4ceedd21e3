"""Inverse p-th roots ``(S + ε I)^(-1/p)`` of batches of symmetric PSD statistics.

Every function takes ``stats`` of shape ``(b, n, n)`` and returns ``(roots, ok)``: roots
``(b, n, n)`` in ``stats.dtype`` and ``ok`` a ``(b,)`` device bool, False where the input was not
finite, the decomposition failed or the root is not finite (that root is a placeholder to
discard). No host read, except inside ``torch.linalg.eigh``, which on CUDA reads its own error
code to raise on failure (caught here as ``ok`` False).
"""

from __future__ import annotations

import torch
from torch import Tensor

from pipefisher.methods.shampoo.method import RootMethod
from pipefisher.methods.symmetric import symmetric_or_identity

ROOT_ORDER = 4  # Shampoo on a matrix preconditions each side with the inverse 4th root
NEWTON_ITERATIONS = 100
NEWTON_ACCEPT_RMS = 1e-3  # a Newton root is ok when RMS(eig(M) - 1) = ||M - I||_F / √n is below this
NEWTON_RISE = 1e-3  # a residual rising by more than this fraction ends a matrix's iteration


def inverse_root(stats: Tensor, epsilon: float, method: RootMethod, p: int = ROOT_ORDER) -> tuple[Tensor, Tensor]:
    """``(sym(S) + ε I)^(-1/p)`` of each matrix of ``stats`` by ``method`` (see the module doc)."""
    if method == "eigen":
        return eigen_root(stats, epsilon, p)
    if method == "newton":
        return newton_root(stats, epsilon, p)
    raise ValueError(f"root must be 'eigen' or 'newton', got {method!r}")


def eigen_root(stats: Tensor, epsilon: float, p: int = ROOT_ORDER) -> tuple[Tensor, Tensor]:
    """``V diag((λ' + ε)^(-1/p)) Vᵀ`` from the float64 eigendecomposition ``V diag(λ) Vᵀ`` of the
    symmetrised statistic, with ``λ' = 0`` where ``λ <= n · eps(stats.dtype) · max|λ|`` (the
    rounding level of an n x n statistic held in ``stats.dtype``, numpy's rank tolerance) and
    ``λ' = λ`` above it. Eigenvalues at or below that level are rounding, not curvature: read as
    they come, their roots (up to ``ε^(-1/p)``) would turn a one-ulp change of the statistic into
    a different update; as zeros they take the root of an exact null direction. So ε bounds the
    root by ``ε^(-1/p)``. Cast back to ``stats.dtype``."""
    sym, finite = symmetric_or_identity(stats.to(torch.float64))
    evals, evecs, decomposed = _eigh(sym)
    del sym  # a refresh's memory is a few copies of its statistics: each goes once used
    rounding = evals.abs().amax(dim=-1, keepdim=True) * (stats.shape[-1] * torch.finfo(stats.dtype).eps)
    evals = torch.where(evals > rounding, evals, 0.0)
    scale = (evals + epsilon).pow(-1.0 / p)
    root = (evecs * scale.unsqueeze(-2)) @ evecs.mT
    ok = finite & decomposed & torch.isfinite(root).all(dim=(-2, -1))
    return root.to(stats.dtype), ok


def newton_root(stats: Tensor, epsilon: float, p: int = ROOT_ORDER) -> tuple[Tensor, Tensor]:
    """Coupled Newton iteration (Guo & Higham 2006) for ``A^(-1/p)``, ``A = sym(S) + ε I``, in
    ``stats.dtype``.

    With ``z = (p + 1) / (2 ||A||_F)``: ``X₀ = z^(1/p) I``, ``M₀ = z A``; each step
    ``Mₚ = ((p + 1) I - M) / p``, ``X <- X Mₚ``, ``M <- Mₚ^p M``, so ``M = X^p A`` tends to I and
    X to ``A^(-1/p)``. The residual ``||M - I||_F`` falls monotonically in exact arithmetic; a
    matrix stops (its last iterate kept by device-side selection) when it rises by more than
    ``NEWTON_RISE`` (rounding floor, or an A made indefinite by rounding: float32 resolves
    eigenvalues down to about 1e-7 ||A|| only, so ε should exceed that) or reaches the rounding
    level. All run exactly ``NEWTON_ITERATIONS`` steps, so no host read decides. ``ok`` also
    requires the final ``||M - I||_F / √n <= NEWTON_ACCEPT_RMS``.
    """
    a, finite = symmetric_or_identity(stats)
    n = a.shape[-1]
    eye = torch.eye(n, dtype=a.dtype, device=a.device)
    a = a + epsilon * eye
    z = (p + 1) / (2 * torch.linalg.matrix_norm(a)).clamp(min=torch.finfo(a.dtype).tiny)
    z = z[:, None, None]
    x = z.pow(1.0 / p) * eye
    m = z * a
    error = torch.linalg.matrix_norm(m - eye)
    tolerance = torch.finfo(a.dtype).eps * n
    active = error > tolerance
    for _ in range(NEWTON_ITERATIONS):
        m_p = m.mul(-1.0 / p).add_(eye, alpha=1.0 + 1.0 / p)
        x_next = x @ m_p
        m_next = torch.linalg.matrix_power(m_p, p) @ m
        error_next = torch.linalg.matrix_norm(m_next - eye)
        accept = active & (error_next <= error * (1.0 + NEWTON_RISE))
        x = torch.where(accept[:, None, None], x_next, x)
        m = torch.where(accept[:, None, None], m_next, m)
        error = torch.where(accept, error_next, error)
        active = accept & (error > tolerance)
    converged = error <= NEWTON_ACCEPT_RMS * n**0.5
    ok = finite & converged & torch.isfinite(x).all(dim=(-2, -1))
    return x, ok


def _eigh(sym: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Batched ``eigh``; when it fails, each matrix alone, so one failure spoils only its own
    entry (returned as NaN with ``decomposed`` False)."""
    ones = torch.ones(sym.shape[0], dtype=torch.bool, device=sym.device)
    try:
        evals, evecs = torch.linalg.eigh(sym)
        return evals, evecs, ones
    except torch.linalg.LinAlgError:
        pass
    evals = torch.full(sym.shape[:-1], float("nan"), dtype=sym.dtype, device=sym.device)
    evecs = torch.full_like(sym, float("nan"))
    decomposed = ~ones
    for i in range(sym.shape[0]):
        try:
            evals[i], evecs[i] = torch.linalg.eigh(sym[i])
            decomposed[i] = True
        except torch.linalg.LinAlgError:
            continue
    return evals, evecs, decomposed
