"""First-order optimizers from the run configuration (PyTorch's own implementations)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pipefisher.config import OptimizerConfig


def build_optimizer(config: OptimizerConfig, parameters: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """SGD (with optional momentum; also the step after K-FAC preconditioning) or AdamW.
    `foreach=False` keeps per-parameter updates identical however parameters are grouped across ranks."""
    parameters = list(parameters)
    if config.name in ("sgd", "kfac"):
        return torch.optim.SGD(parameters, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay, foreach=False)
    if config.name == "adamw":
        return torch.optim.AdamW(parameters, lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay, foreach=False)
    raise ValueError(f"optimizer.name: {config.name!r} is not one of sgd, adamw, kfac")
