"""Learning-rate schedule: linear warm-up, then polynomial decay (BERT's schedule for power 1)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WarmupDecay:
    """Multiplier of the base lr at optimizer step `step` (0-based): step/warmup_steps during
    warm-up, then final + (1 − final)·(1 − progress)^power with progress 0 → 1 over the decay
    steps, and final_fraction from total_steps on. power 0 with final_fraction 1 is warm-up then constant."""

    warmup_steps: int
    total_steps: int
    power: float = 1.0
    final_fraction: float = 0.0

    def __post_init__(self) -> None:
        for name in ("warmup_steps", "total_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}: expected a non-negative integer, got {value!r}")
        if self.total_steps < 1 or self.total_steps < self.warmup_steps:
            raise ValueError(
                f"total_steps: expected >= 1 and >= warmup_steps ({self.warmup_steps}), got {self.total_steps}"
            )
        for name in ("power", "final_fraction"):
            if not isinstance(getattr(self, name), (int, float)) or isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected a number, got {getattr(self, name)!r}")
        if not self.power >= 0.0:
            raise ValueError(f"power: expected >= 0, got {self.power!r}")
        if not 0.0 <= self.final_fraction <= 1.0:
            raise ValueError(f"final_fraction: expected a number in [0, 1], got {self.final_fraction!r}")

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return step / self.warmup_steps
        if step >= self.total_steps:
            return self.final_fraction
        remaining = (self.total_steps - step) / (self.total_steps - self.warmup_steps)
        return self.final_fraction + (1.0 - self.final_fraction) * remaining**self.power


def warmup_decay(
    optimizer: torch.optim.Optimizer,
    warmup_steps: int,
    total_steps: int,
    power: float = 1.0,
    final_fraction: float = 0.0,
    position: int = 0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR with the WarmupDecay multiplier for every parameter group; call its step() after
    each optimizer step. Its state_dict round-trips the schedule's settings. `position`: the
    optimizer steps already taken (a resumed run; its groups keep their base rate as
    `initial_lr`, as a scheduler's optimizer state does): the rates start there."""
    if position:
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, WarmupDecay(warmup_steps, total_steps, power, final_fraction), last_epoch=position - 1
    )
