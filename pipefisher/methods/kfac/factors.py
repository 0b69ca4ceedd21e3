"""Pure K-FAC maths on tensors: curvature accumulation, EMA, damped inverses, preconditioning.

Conventions (shared by every caller):
- A factor is a symmetric PSD matrix in float32 or wider (:func:`factor_dtype`).
- Damping is factored Tikhonov: the curvature of a layer is approximated by
  ``(A + sqrt(damping) I) ⊗ (B + sqrt(damping) I)``, i.e. ``A ⊗ B + damping·I`` plus the cross
  terms ``sqrt(damping)·(A ⊗ I + I ⊗ B)``. Each factor is inverted on its own.
- A gradient matrix ``G`` has shape ``(dout, din)`` or ``(dout, din + 1)`` (bias as last column).
- Rows of a factor (`curvature_rows`): with ``expand`` one per token; with ``reduce`` (K-FAC-reduce,
  Eschenhagen et al. 2023, as curvlinops' ``kfac_approx="reduce"``) one per sequence of a
  ``(batch, positions..., d)`` capture: ``A = (1/N) Σ_n ā_n ā_nᵀ`` with ``ā_n`` the mean input over
  sequence n's positions, ``B = (1/R) Σ_n ḡ_n ḡ_nᵀ`` with ``ḡ_n = Σ_t λ e_{n,t}``, N sequences, R = N·T
  tokens (B's mean and its scale λ stay per token). A 2-D capture has no positions: both agree.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from pipefisher.methods.blocks import Factor
from pipefisher.methods.kfac.method import INVERSE_METHODS, Approximation, InverseMethod


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


def curvature_rows(
    record: Tensor, factor: Factor, approximation: Approximation, dtype: torch.dtype
) -> tuple[Tensor, int]:
    """One capture's rows of `factor` ("A" inputs, "B" output gradients) as ``(n, d)`` in `dtype`
    and the tokens each counts for in the factor's row count (module doc): ``expand`` every
    token, 1 each; ``reduce`` each sequence (the first dimension), its positions averaged (A,
    counting 1) or summed (B, counting the positions)."""
    width = record.shape[-1]
    if approximation == "expand" or record.dim() < 3:
        return record.reshape(-1, width), 1
    positions = record.reshape(record.shape[0], -1, width).to(dtype)
    if factor == "A":
        return positions.mean(dim=1), 1
    return positions.sum(dim=1), positions.shape[1]


def condensed_record(part: Factor, record: Tensor) -> Tensor:
    """What K-FAC-reduce holds of a capture of `part` (`pipefisher.methods.capture.Condense`): a
    ``(batch, positions..., d)`` record's mean over its positions in float32 or wider, broadcast back
    over them (a stride-0 view: batch x d elements held), from which `curvature_rows` takes the same
    rows and counts; a record without positions as it is."""
    if record.dim() < 3:
        return record
    positions = record.reshape(record.shape[0], -1, record.shape[-1])
    mean = positions.to(factor_dtype(record.dtype)).mean(dim=1, keepdim=True)
    return mean.expand(positions.shape)


def fold_ema(previous: Tensor | None, fresh: Tensor, decay: float) -> Tensor:
    """Exponential moving average ``decay·previous + (1 - decay)·fresh``; ``fresh`` if no previous."""
    if previous is None or decay == 0.0:
        return fresh.clone()
    return previous.mul(decay).add_(fresh, alpha=1.0 - decay)


def factor_damping(damping: float) -> float:
    """The amount added to each factor's diagonal for Kronecker damping ``damping``."""
    return math.sqrt(damping)


def damping_too_small(factor: Tensor, damping: float) -> Tensor:
    """0-dim device bool: adding ``sqrt(damping)`` to the largest diagonal entry is lost to rounding.

    Then the damped factor equals the undamped one in ``factor.dtype`` and its inverse is
    governed by rounding noise rather than by the damping. Compared in float64, no host read.
    """
    if factor.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=factor.device)
    scale = factor.diagonal().abs().max().to(torch.float64)
    return torch.finfo(factor.dtype).eps * scale > factor_damping(damping)


def damped_inverse(factor: Tensor, damping: float, method: InverseMethod = "eigen") -> tuple[Tensor, Tensor]:
    """``(F + sqrt(damping) I)⁻¹`` of a symmetric (n, n) factor, in ``factor.dtype``, and ``ok``.

    ``ok`` (0-dim device bool) is False when the decomposition failed or the result is not
    finite; the inverse is then a placeholder to discard. ``eigen``: ``F = Q diag(d) Qᵀ``, result
    ``Q diag(1 / (max(d, 0) + sqrt(damping))) Qᵀ`` (negative eigenvalues from rounding are
    clamped). ``cholesky``: ``L⁻ᵀ L⁻¹`` from the Cholesky factor ``L`` of the damped matrix (no
    clamping). No host read, except inside ``torch.linalg.eigh``, which on CUDA reads its own
    error code to raise on failure (unavoidable; caught here as ``ok`` False).
    """
    if method not in _INVERSES:
        raise ValueError(f"unknown inverse method {method!r}; expected one of {INVERSE_METHODS}")
    inv, decomposed = _INVERSES[method](factor, factor_damping(damping))
    return inv, decomposed & torch.isfinite(inv).all()


def _symmetric(factor: Tensor) -> Tensor:
    return (factor + factor.T) / 2


def _eigen_inverse(factor: Tensor, delta: float) -> tuple[Tensor, Tensor]:
    """Each temporary freed once used: 3 copies of the factor at most beside it."""
    sym = _symmetric(factor)
    try:
        evals, evecs = torch.linalg.eigh(sym)
    except torch.linalg.LinAlgError:
        return _eye(factor), torch.zeros((), dtype=torch.bool, device=factor.device)
    del sym
    inv = (evecs / (evals.clamp(min=0.0) + delta)) @ evecs.T
    return inv, torch.ones((), dtype=torch.bool, device=factor.device)


def _cholesky_inverse(factor: Tensor, delta: float) -> tuple[Tensor, Tensor]:
    """Through ``cholesky_ex`` (its ``info`` stays on the device) and a triangular solve, which
    checks nothing (``torch.cholesky_inverse`` would read error codes on the host). Each
    temporary freed once used: 4 copies of the factor at most beside it."""
    eye = _eye(factor)
    damped = _symmetric(factor) + delta * eye
    chol, info = torch.linalg.cholesky_ex(damped)
    del damped
    chol_inv = torch.linalg.solve_triangular(chol, eye, upper=False)
    del chol, eye
    return chol_inv.T @ chol_inv, info == 0


def _eye(like: Tensor) -> Tensor:
    return torch.eye(like.shape[0], dtype=like.dtype, device=like.device)


_INVERSES = {"eigen": _eigen_inverse, "cholesky": _cholesky_inverse}


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


def kl_clip_scale(vg_sum: Tensor, kl_clip: float, lr: float) -> Tensor:
    """KL-clip factor ``min(1, sqrt(kl_clip / (lr² · vg_sum)))`` with ``vg_sum = Σ ⟨G̃, G⟩``.

    Multiplying every preconditioned gradient by it bounds the predicted KL change of one step
    (``lr² · Σ ⟨G̃, G⟩``) by ``kl_clip``. A non-positive or non-finite ``vg_sum`` gives 1.
    ``vg_sum``: 0-dim tensor; the result has its dtype and device (no host read).
    """
    quad = vg_sum * (lr * lr)
    valid = torch.isfinite(quad) & (quad > 0)
    return torch.where(valid, torch.sqrt(kl_clip / quad).clamp(max=1.0), torch.ones_like(quad))
