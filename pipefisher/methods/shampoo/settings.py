"""Shampoo hyper-parameters, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

RootMethod = Literal["eigen", "newton"]
Grafting = Literal["adam", "sgd", "none"]
ROOT_METHODS: tuple[str, ...] = ("eigen", "newton")
GRAFTINGS: tuple[str, ...] = ("adam", "sgd", "none")
DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64)


@dataclass(frozen=True)
class ShampooSettings:
    """Shampoo with per-block statistics and grafting (see :mod:`pipefisher.methods.shampoo.engine`).

    ``beta2`` in (0, 1]: statistics ``S <- beta2 S + (1 - beta2) G Gᵀ`` (1: plain sum
    ``S <- S + G Gᵀ``). ``epsilon`` > 0: roots are ``(S + epsilon I)^(-1/4)``. ``block_size``:
    longer dimensions are cut into blocks of this many (the last may be shorter). ``root``:
    ``eigen`` (float64 eigendecomposition) or ``newton`` (coupled Newton iteration in ``dtype``).
    ``grafting``: the per-block step size comes from Adam's or SGD's direction, or none.
    ``graft_beta2`` in [0, 1), ``graft_epsilon`` > 0: Adam grafting's second moment decay and
    denominator term. ``start_step``: precondition calls ``t <= start_step`` (t counted from 1)
    use the grafting direction alone. ``dtype``: float32 or float64, of the captured gradient,
    roots and grafting state. ``statistics_dtype``: float64 (default) or float32, of the
    statistics: a statistic ``G Gᵀ`` squares the gradient's condition number, so float32 resolves
    its eigenvalues only down to about ``1e-7 λ_max``; below that a root with a small ``epsilon``
    amplifies rounding (any change in the order of a sum) into a different update.
    ``matrices_only``: the engine holds and rewrites only the matrices, leaving every other
    parameter to the run's first-order rule (False: those take the grafting direction).
    """

    beta2: float = 1.0
    epsilon: float = 1e-12
    block_size: int = 1024
    root: RootMethod = "eigen"
    grafting: Grafting = "adam"
    graft_beta2: float = 0.999
    graft_epsilon: float = 1e-8
    start_step: int = 0
    dtype: torch.dtype = torch.float32
    statistics_dtype: torch.dtype = torch.float64
    matrices_only: bool = False

    def __post_init__(self) -> None:
        if not 0.0 < self.beta2 <= 1.0:
            raise ValueError(f"beta2 must be in (0, 1], got {self.beta2}")
        if not (self.epsilon > 0.0 and math.isfinite(self.epsilon)):
            raise ValueError(f"epsilon must be a finite positive number, got {self.epsilon}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {self.block_size!r}")
        if self.root not in ROOT_METHODS:
            raise ValueError(f"root must be one of {ROOT_METHODS}, got {self.root!r}")
        if self.grafting not in GRAFTINGS:
            raise ValueError(f"grafting must be one of {GRAFTINGS}, got {self.grafting!r}")
        if not 0.0 <= self.graft_beta2 < 1.0:
            raise ValueError(f"graft_beta2 must be in [0, 1), got {self.graft_beta2}")
        if not (self.graft_epsilon > 0.0 and math.isfinite(self.graft_epsilon)):
            raise ValueError(f"graft_epsilon must be a finite positive number, got {self.graft_epsilon}")
        if isinstance(self.start_step, bool) or not isinstance(self.start_step, int) or self.start_step < 0:
            raise ValueError(f"start_step must be an integer >= 0, got {self.start_step!r}")
        for name in ("dtype", "statistics_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name} must be torch.float32 or torch.float64, got {getattr(self, name)}")
