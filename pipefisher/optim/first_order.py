"""The first-order rules (SGD, AdamW, LAMB) over parameter groups, and the groups themselves."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from pipefisher.optim.settings import OptimizerConfig
from pipefisher.runtime.primitives.sharding import is_sharded


def no_decay(name: str) -> bool:
    """Biases and LayerNorm weights get no weight decay (the BERT convention)."""
    return name.endswith("bias") or "norm" in name.lower()


def parameter_groups(
    modules: Iterable[nn.Module], weight_decay: float, keep: Callable[[nn.Parameter], bool] = lambda parameter: True
) -> list[dict]:
    """Parameters of `modules` (each once, those `keep` accepts) split into decayed and undecayed
    groups (either may be empty)."""
    decayed: list[nn.Parameter] = []
    undecayed: list[nn.Parameter] = []
    seen: set[int] = set()
    for module in modules:
        for name, parameter in module.named_parameters():
            if id(parameter) in seen or not keep(parameter):
                continue
            seen.add(id(parameter))
            (undecayed if no_decay(name) else decayed).append(parameter)
    return [{"params": decayed, "weight_decay": weight_decay}, {"params": undecayed, "weight_decay": 0.0}]


def named(module: nn.Module, names: Iterable[str]) -> list[nn.Parameter]:
    """The parameters of `module` called `names` (tied copies answer to each of their names)."""
    by_name = dict(module.named_parameters(remove_duplicate=False))
    return [by_name[name] for name in names]


def first_order(settings: OptimizerConfig, groups: list[dict]) -> torch.optim.Optimizer:
    """SGD (with optional momentum), AdamW or LAMB (`settings.name`) over `groups`. Each updates
    every parameter tensor on its own, so its update is identical however parameters are grouped
    across ranks, and none reads a tensor into Python: SGD without momentum fused (one kernel per
    device and dtype; torch's choice for ZeRO-2/3's DTensor shards, which its fused kernel does not
    take); with momentum torch's choice, multi-tensor on CUDA and one tensor at a
    time on a CPU (the fused kernel starts all momentum buffers at once: a parameter whose first
    gradient comes in a later step than the others' fails); AdamW fused (its step counter on the
    parameter's device); LAMB `pipefisher.optim.lamb.Lamb`, multi-tensor."""
    if settings.name == "sgd":
        sharded = any(is_sharded(p) for group in groups for p in group["params"])
        fused = True if settings.momentum == 0 and not sharded else None
        return torch.optim.SGD(groups, lr=settings.lr, momentum=settings.momentum, fused=fused)
    if settings.name == "adamw":
        return torch.optim.AdamW(groups, lr=settings.lr, betas=settings.betas, eps=settings.eps, fused=True)
    if settings.name == "lamb":
        from pipefisher.optim.lamb import Lamb

        return Lamb(groups, lr=settings.lr, betas=settings.betas, eps=settings.eps)
    raise ValueError(f"optimizer.name: {settings.name!r} is not a first-order rule (sgd, adamw, lamb)")
