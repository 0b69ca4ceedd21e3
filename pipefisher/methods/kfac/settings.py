"""The K-FAC engine's hyper-parameters, its warning and its preconditioning report."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from pipefisher.methods.kfac.factors import INVERSE_METHODS, InverseMethod


class KFACNumericsWarning(RuntimeWarning):
    """A layer skipped an inversion or has damping lost to float rounding."""


@dataclass(frozen=True)
class KFACConfig:
    """K-FAC hyper-parameters.

    ``damping`` λ > 0: curvature ``(A + √λ I) ⊗ (B + √λ I)``. ``factor_decay`` in [0, 1): EMA
    weight of the old factor (0 = fresh factor only). ``kl_clip``: bound on ``lr² Σ⟨G̃, G⟩`` or
    None. ``grad_scale``: λ in the B scaling (None = row count). ``max_factor_dim``: larger
    layers stay first-order.
    """

    damping: float = 1e-3
    factor_decay: float = 0.95
    inverse: InverseMethod = "cholesky"
    kl_clip: float | None = None
    grad_scale: float | None = None
    max_factor_dim: int = 8192

    def __post_init__(self) -> None:
        if not (self.damping > 0.0 and math.isfinite(self.damping)):
            raise ValueError(f"damping must be a finite positive number, got {self.damping}")
        if math.sqrt(self.damping) < torch.finfo(torch.float32).tiny:
            raise ValueError(f"damping {self.damping:g} underflows in float32")
        if not 0.0 <= self.factor_decay < 1.0:
            raise ValueError(f"factor_decay must be in [0, 1), got {self.factor_decay}")
        if self.inverse not in INVERSE_METHODS:
            raise ValueError(f"inverse must be one of {INVERSE_METHODS}, got {self.inverse!r}")
        if self.kl_clip is not None and not self.kl_clip > 0.0:
            raise ValueError(f"kl_clip must be positive or None, got {self.kl_clip}")
        if self.grad_scale is not None and not self.grad_scale > 0.0:
            raise ValueError(f"grad_scale must be positive or None, got {self.grad_scale}")


@dataclass(frozen=True)
class PreconditionReport:
    """Outcome of one whole-model precondition, as 0-dim float64 tensors on the parameters'
    device (read them with ``float()``, a host read): ``vg_sum = Σ⟨G̃, G⟩`` before clipping and
    the factor (≤ 1) all preconditioned gradients were multiplied by. Both None without
    ``kl_clip`` (not computed)."""

    vg_sum: Tensor | None
    clip_scale: Tensor | None
