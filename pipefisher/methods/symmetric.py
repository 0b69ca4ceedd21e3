"""The symmetrised statistics a refresh decomposes, as SOAP's bases and Shampoo's roots take them:
one new tensor, the rest in place (a refresh's memory is a few copies of its statistics)."""

from __future__ import annotations

from torch import Tensor


def symmetric_or_identity(stats: Tensor) -> tuple[Tensor, Tensor]:
    """``(S + Sᵀ) / 2`` of each ``(b, n, n)`` statistic as a new tensor, the identity for a
    non-finite one (so no NaN reaches a decomposition), and the ``(b,)`` finiteness of the
    inputs; the bits of ``torch.where(finite, (S + Sᵀ) / 2, I)``."""
    finite = stats.isfinite().all(dim=(-2, -1))
    sym = stats + stats.mT
    sym.mul_(0.5).nan_to_num_(0.0, 0.0, 0.0).mul_(finite[:, None, None])
    sym.diagonal(dim1=-2, dim2=-1).add_((~finite)[:, None].to(stats.dtype))
    return sym, finite
