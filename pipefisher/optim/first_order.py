"""Optimizers and learning-rate schedules from the run configuration."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from pipefisher.config import OptimizerConfig, RunConfig
from pipefisher.methods.registry import methods


def no_decay(name: str) -> bool:
    """Biases and LayerNorm weights get no weight decay (the BERT convention)."""
    return name.endswith("bias") or "norm" in name.lower()


def parameter_groups(modules: Iterable[nn.Module], weight_decay: float,
                     keep: Callable[[nn.Parameter], bool] = lambda parameter: True) -> list[dict]:
    """Parameters of `modules` (each once, those `keep` accepts) split into decayed and undecayed
    groups (either may be empty)."""
    decayed, undecayed, seen = [], [], set()
    for module in modules:
        for name, parameter in module.named_parameters():
            if id(parameter) in seen or not keep(parameter):
                continue
            seen.add(id(parameter))
            (undecayed if no_decay(name) else decayed).append(parameter)
    return [{"params": decayed, "weight_decay": weight_decay}, {"params": undecayed, "weight_decay": 0.0}]


def build_optimizer(config: OptimizerConfig, modules: Iterable[nn.Module],
                    keep: Callable[[nn.Parameter], bool] = lambda parameter: True) -> torch.optim.Optimizer:
    """SGD (with optional momentum; also the step after K-FAC or Shampoo preconditioning), AdamW or
    LAMB over the parameters of `modules` that `keep` accepts (ZeRO-1: the rank's own).
    `foreach=False` keeps per-parameter updates identical however parameters are grouped across ranks."""
    groups = parameter_groups(modules, config.weight_decay, keep)
    if config.name == "sgd" or config.name in methods():  # a curvature method preconditions, then SGD steps
        return torch.optim.SGD(groups, lr=config.lr, momentum=config.momentum, foreach=False)
    if config.name == "adamw":
        return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps, foreach=False)
    if config.name == "lamb":
        from pipefisher.optim.lamb import Lamb

        return Lamb(groups, lr=config.lr, betas=config.betas, eps=config.eps)
    raise ValueError(f"optimizer.name: {config.name!r} is not one of sgd, adamw, lamb, {', '.join(methods())}")


def build_scheduler(config: RunConfig, optimizer: torch.optim.Optimizer, position: int = 0) -> torch.optim.lr_scheduler.LRScheduler | None:
    """Warm-up then constant or linear decay over the run's steps (run.steps, so a resumed run
    must keep its step count), starting after `position` optimizer steps (a resumed run, whose
    optimizer state is loaded); None when the rate is constant."""
    settings = config.optimizer
    if settings.warmup_steps == 0 and settings.decay == "constant":
        return None
    from pipefisher.optim.schedule import warmup_decay

    total = settings.decay_steps or config.run.steps
    warmup = min(settings.warmup_steps, total)  # a short run (e.g. a smoke test) stays in warm-up
    if settings.decay == "constant":
        return warmup_decay(optimizer, warmup, total, power=0.0, final_fraction=1.0, position=position)
    return warmup_decay(optimizer, warmup, total, power=1.0, final_fraction=0.0, position=position)
