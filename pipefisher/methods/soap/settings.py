"""SOAP hyper-parameters of the engine, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64)


@dataclass(frozen=True)
class SoapSettings:
    """SOAP (see :mod:`pipefisher.methods.soap.engine`). ``beta1``, ``beta2`` in [0, 1): decays of
    Adam's first moment (original basis) and second moment (eigenbasis); ``statistics_beta`` in
    [0, 1): decay of the statistics, ``L <- lerp(L, G Gᵀ, 1 - statistics_beta)`` (None: ``beta2``;
    pytorch_optimizer's ``shampoo_beta``);
    ``epsilon`` > 0: added to ``√v``; ``block_size``: longer dimensions are cut into blocks of this
    many (the last may be shorter); ``dtype``: float32 or float64 of the eigenbases and moments;
    ``statistics_dtype``: of the statistics, their snapshot and the refresh maths (float64 by
    default: it resolves the statistics' null space far below the tie-break that fixes the
    eigenbasis there, `pipefisher.methods.soap.basis`)."""

    beta1: float = 0.95
    beta2: float = 0.95
    statistics_beta: float | None = None
    epsilon: float = 1e-8
    block_size: int = 1024
    dtype: torch.dtype = torch.float32
    statistics_dtype: torch.dtype = torch.float64

    def __post_init__(self) -> None:
        for name in ("beta1", "beta2", "statistics_beta"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value}")
        if not (self.epsilon > 0.0 and math.isfinite(self.epsilon)):
            raise ValueError(f"epsilon must be a finite positive number, got {self.epsilon}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {self.block_size!r}")
        for name in ("dtype", "statistics_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name} must be torch.float32 or torch.float64, got {getattr(self, name)}")

    @property
    def statistics_decay(self) -> float:
        """The decay of the statistics in use: ``statistics_beta``, or ``beta2`` when it is None."""
        return self.beta2 if self.statistics_beta is None else self.statistics_beta
