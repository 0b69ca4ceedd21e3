"""SOAP's eigenbases of batches of symmetric PSD statistics ``(b, n, n)``: the first by an
eigendecomposition, later ones by one step of power iteration and a QR decomposition from the
basis in use (Vyas et al. 2024), columns ordered by decreasing (estimated) eigenvalue.

Both work on ``S̃ = sym(S) + τ ‖S‖_F diag(1, 2, …, n) / n`` (τ = `TIE_BREAK`). A statistic of a few
steps' gradients is singular (``G Gᵀ`` of an m × n gradient has rank ≤ n), and any orthonormal
basis of its null space is an eigenbasis there; Adam in the eigenbasis depends on that choice, so
a plain decomposition would take it from rounding, another one for any other order of summing the
gradient (data-parallel replicas, another schedule), and the power iteration would orthonormalise
rounding there. The ramp makes the choice a function of the statistic: in the null space the
eigenvectors of the projected ramp, apart by ``τ ‖S‖ / n``, far above float64's rounding of S
(about ``n ε ‖S‖``) for n up to a few thousand; elsewhere it turns an eigenvector by about
``τ ‖S‖ / gap``, less than a float32 decomposition's own error (``6e-8 ‖S‖ / gap``).

Each returns ``ok`` ``(b,)`` device bools, False where the statistic was not finite or the result
is not (the caller keeps its previous basis there). No host read, except inside
``torch.linalg.eigh`` and ``torch.linalg.qr``, which on CUDA read their error codes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pipefisher.methods.symmetric import symmetric_or_identity

#: relative size of the tie-break ramp added to a statistic (see the module doc)
TIE_BREAK = 1e-8


def tie_broken(stats: Tensor) -> tuple[Tensor, Tensor]:
    """``S̃`` of each statistic (see the module doc), the identity for a non-finite one, and the
    ``(b,)`` finiteness of the inputs. One new ``(b, n, n)`` tensor: the rest is done in place."""
    n = stats.shape[-1]
    sym, finite = symmetric_or_identity(stats)
    diagonal = sym.diagonal(dim1=-2, dim2=-1)
    ramp = torch.arange(1, n + 1, dtype=stats.dtype, device=stats.device) * (TIE_BREAK / n)
    diagonal.add_(torch.linalg.matrix_norm(sym)[:, None] * ramp)
    return sym, finite


def eigenbasis(stats: Tensor) -> tuple[Tensor, Tensor]:
    """The eigenvectors of each ``S̃`` by decreasing eigenvalue, as columns, in ``stats.dtype``."""
    tilted, finite = tie_broken(stats)
    vectors, decomposed = _eigenvectors(tilted)
    basis = vectors.flip(-1)
    return basis, finite & decomposed & torch.isfinite(basis).all(dim=(-2, -1))


def power_basis(stats: Tensor, basis: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One power-iteration step from ``basis`` (columns, any float dtype): the estimated eigenvalues
    ``diag(Qᵀ S̃ Q)`` sort the columns of ``S̃ Q`` by decreasing value (stable), and their QR
    decomposition's Q is the new basis. Returns it (``stats.dtype``), the ``(b, n)`` int64 order
    (new column i continues old column ``order[i]``) and ``ok``."""
    tilted, finite = tie_broken(stats)
    current = basis.to(stats.dtype)
    product = tilted @ current
    del tilted  # each (b, n, n) temporary goes as soon as it is used: a refresh's memory is several of them
    estimate = (current * product).sum(dim=-2)
    del current
    order = torch.argsort(estimate, dim=-1, descending=True, stable=True)
    reflectors, scales = torch.geqrf(product.gather(-1, order[:, None, :].expand_as(product)))
    del product
    fresh = torch.linalg.householder_product(reflectors, scales)  # QR's Q, without R beside it
    return fresh, order, finite & torch.isfinite(fresh).all(dim=(-2, -1))


def _eigenvectors(sym: Tensor) -> tuple[Tensor, Tensor]:
    """Batched ``eigh`` eigenvectors (ascending eigenvalues); when it fails, each matrix alone, so
    one failure spoils only its own entry (NaN, ``decomposed`` False)."""
    ones = torch.ones(sym.shape[0], dtype=torch.bool, device=sym.device)
    try:
        return torch.linalg.eigh(sym).eigenvectors, ones
    except torch.linalg.LinAlgError:
        pass
    vectors = torch.full_like(sym, float("nan"))
    decomposed = ~ones
    for i in range(sym.shape[0]):
        try:
            vectors[i] = torch.linalg.eigh(sym[i]).eigenvectors
            decomposed[i] = True
        except torch.linalg.LinAlgError:
            continue
    return vectors, decomposed
