"""The K-FAC engine's check of its settings (the run-file section `KfacConfig`), its warning and its
preconditioning report."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from pipefisher.core.settings import check_section
from pipefisher.methods.kfac.method import KFAC, KfacConfig


class KFACNumericsWarning(RuntimeWarning):
    """A layer skipped an inversion or has damping lost to float rounding."""


def check_engine_settings(config: KfacConfig, grad_scale: float | None, kl_clip: float | None) -> KfacConfig:
    """`config` when the engine can run it (`check_section` of its run-file keys; its damping's
    square root must not underflow in float32) with the engine's own values: ``grad_scale`` λ in
    the B scaling (None = row count) and ``kl_clip``, the bound on ``lr² Σ⟨G̃, G⟩`` (None = no
    clipping), each positive or None; ValueError (a ConfigError for a run-file key) naming the
    value otherwise."""
    check_section(config, KFAC.name)
    if math.sqrt(config.damping) < torch.finfo(torch.float32).tiny:
        raise ValueError(f"damping {config.damping:g} underflows in float32")
    for name, value in (("grad_scale", grad_scale), ("kl_clip", kl_clip)):
        if value is not None and not value > 0.0:
            raise ValueError(f"{name} must be positive or None, got {value}")
    return config


@dataclass(frozen=True)
class PreconditionReport:
    """Outcome of one whole-model precondition, as 0-dim float64 tensors on the parameters'
    device (read them with ``float()``, a host read): ``vg_sum = Σ⟨G̃, G⟩`` before clipping and
    the factor (≤ 1) all preconditioned gradients were multiplied by. Both None without
    ``kl_clip`` (not computed)."""

    vg_sum: Tensor | None
    clip_scale: Tensor | None
