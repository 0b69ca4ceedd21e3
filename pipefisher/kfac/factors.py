"""Pure K-FAC maths on tensors: curvature accumulation, EMA, damped inverses, preconditioning.

Conventions (shared by every caller):
- A factor is a symmetric PSD matrix in float32 or wider (:func:`factor_dtype`).
- Damping is factored Tikhonov: the curvature of a layer is approximated by
  ``(A + sqrt(damping) I) ⊗ (B + sqrt(damping) I)``, i.e. ``A ⊗ B + damping·I`` plus the cross
  terms ``sqrt(damping)·(A ⊗ I + I ⊗ B)``. Each factor is inverted on its own.
- A gradient matrix ``G`` has shape ``(dout, din)`` or ``(dout, din + 1)`` (bias as last column).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

InverseMethod = Literal["eigen", "cholesky"]
INVERSE_METHODS: tuple[str, ...] = ("eigen", "cholesky")


class InversionError(RuntimeError):
    """A damped inverse could not be computed (failed decomposition or non-finite result)."""


def factor_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype factors of a layer with parameters of ``dtype`` are kept in: float32 or wider."""
    return torch.promote_types(dtype, torch.float32)


def accumulate_covariance(total: Tensor, rows: Tensor, ones_column: bool) -> None:
    """In place ``total += xᵀx`` with ``x = [rows, 1]`` if ``ones_column`` else ``rows``.

    ``rows``: (n, d) in any float dtype (cast to ``total.dtype``); ``total``: (d + ones_column)
    square. The ones column is never materialised: its blocks are ``Σ rows`` and ``n``.
    """
    x = rows.to(total.dtype)
    d = x.shape[1]
    total[:d, :d].addmm_(x.T, x)
    if ones_column:
        s = x.sum(dim=0)
        total[:d, d].add_(s)
        total[d, :d].add_(s)
        total[d, d].add_(x.shape[0])


def fold_ema(previous: Tensor | None, fresh: Tensor, decay: float) -> Tensor:
    """Exponential moving average ``decay·previous + (1 - decay)·fresh``; ``fresh`` if no previous."""
    if previous is None or decay == 0.0:
        return fresh.clone()
    return previous.mul(decay).add_(fresh, alpha=1.0 - decay)


def factor_damping(damping: float) -> float:
    """The amount added to each factor's diagonal for Kronecker damping ``damping``."""
    return math.sqrt(damping)


def damping_too_small(factor: Tensor, damping: float) -> bool:
    """True when adding ``sqrt(damping)`` to the largest diagonal entry is lost to rounding.

    Then the damped factor equals the undamped one in ``factor.dtype`` and its inverse is
    governed by rounding noise rather than by the damping.
    """
    scale = factor.diagonal().abs().max().item() if factor.numel() else 0.0
    return factor_damping(damping) < torch.finfo(factor.dtype).eps * scale


def damped_inverse(factor: Tensor, damping: float, method: InverseMethod = "eigen") -> Tensor:
    """``(F + sqrt(damping) I)⁻¹`` of a symmetric (n, n) factor, in ``factor.dtype``.

    ``eigen``: ``F = Q diag(d) Qᵀ``, result ``Q diag(1 / (max(d, 0) + sqrt(damping))) Qᵀ``
    (negative eigenvalues from rounding are clamped). ``cholesky``: inverse through the Cholesky
    factor of the damped matrix (no clamping). Raises :class:`InversionError` on failure.
    """
    delta = factor_damping(damping)
    sym = (factor + factor.T) / 2
    try:
        if method == "eigen":
            evals, evecs = torch.linalg.eigh(sym)
            inv = (evecs / (evals.clamp(min=0.0) + delta)) @ evecs.T
        elif method == "cholesky":
            damped = sym + delta * torch.eye(sym.shape[0], dtype=sym.dtype, device=sym.device)
            chol, info = torch.linalg.cholesky_ex(damped)
            if info.item() != 0:
                raise InversionError(f"Cholesky failed at minor {info.item()}")
            inv = torch.cholesky_inverse(chol)
        else:
            raise ValueError(f"unknown inverse method {method!r}; expected one of {INVERSE_METHODS}")
    except torch.linalg.LinAlgError as exc:
        raise InversionError(str(exc)) from exc
    if not torch.isfinite(inv).all():
        raise InversionError("non-finite inverse")
    return inv


def precondition_matrix(grad: Tensor, a_inv: Tensor | None, b_inv: Tensor | None) -> Tensor:
    """``B⁻¹ G A⁻¹`` for ``grad`` (dout, din[+1]); a missing inverse acts as the identity.

    Computed in the inverses' dtype (float32 or wider); the result has that dtype.
    """
    dtype = next((t.dtype for t in (a_inv, b_inv) if t is not None), factor_dtype(grad.dtype))
    out = grad.to(dtype)
    if b_inv is not None:
        out = b_inv @ out
    if a_inv is not None:
        out = out @ a_inv
    return out


def kl_clip_scale(vg_sum: float, kl_clip: float, lr: float) -> float:
    """KL-clip factor ``min(1, sqrt(kl_clip / (lr² · vg_sum)))`` with ``vg_sum = Σ ⟨G̃, G⟩``.

    Multiplying every preconditioned gradient by it bounds the predicted KL change of one step
    (``lr² · Σ ⟨G̃, G⟩``) by ``kl_clip``. A non-positive or non-finite ``vg_sum`` gives 1.
    """
    quad = lr * lr * vg_sum
    if not math.isfinite(quad) or quad <= 0.0:
        return 1.0
    return min(1.0, math.sqrt(kl_clip / quad))

