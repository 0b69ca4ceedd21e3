"""TF32 for float32 matrix products on CUDA (`run.tf32`): torch's process-wide flag, set and read
through the API the installed torch has (``fp32_precision`` from torch 2.9, ``allow_tf32``
before it; mixing the two makes torch warn). A CPU's products do not change."""

from __future__ import annotations

import torch


def set_tf32(enabled: bool) -> None:
    """CUDA float32 matrix products on TF32 tensor cores (`enabled`) or in full float32; the flag
    is written only when it changes (a process that never asks for TF32 keeps torch's default)."""
    if tf32_enabled() == enabled:
        return
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        matmul.fp32_precision = "tf32" if enabled else "ieee"
    else:
        matmul.allow_tf32 = enabled


def tf32_enabled() -> bool:
    """Whether CUDA float32 matrix products run on TF32 tensor cores."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        chosen = matmul.fp32_precision
        return chosen == "tf32" or (chosen == "none" and getattr(torch.backends, "fp32_precision", "") == "tf32")
    return bool(matmul.allow_tf32)
