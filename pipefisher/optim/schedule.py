"""Learning-rate schedules as one multiplier of the base rate: linear warm-up, a hold, then a decay
whose curve is one of `CURVES` down to a floor. BERT's linear decay, polynomial decay, cosine decay
and warm-up–stable–decay (WSD) are all settings of `WarmupDecay`; `warmup_decay` applies it to every
parameter group of an optimizer (a curvature run's `Composite`: the method's rate and the rest's)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

#: the decay's curve: progress p (0 → 1 over the decay) -> the share of (1 − floor) still left
CURVES: dict[str, Callable[[float, float], float]] = {
    "polynomial": lambda p, power: (1.0 - p) ** power,
    "cosine": lambda p, power: 0.5 * (1.0 + math.cos(math.pi * p)),
    "sqrt": lambda p, power: 1.0 - math.sqrt(p),
    "constant": lambda p, power: 1.0,
}


@dataclass(frozen=True)
class WarmupDecay:
    """Multiplier of the base lr at optimizer step `step` (0-based):

    - step/warmup_steps during warm-up (steps 0 .. warmup_steps − 1);
    - 1 until the decay starts at `decay_start` = max(warmup_steps, total_steps − round(decay_fraction ·
      total_steps)): at warmup_steps for decay_fraction 1, later for WSD (decay_fraction < 1);
    - final_fraction + (1 − final_fraction)·curve(p) with p = (step − decay_start)/(total_steps −
      decay_start) going 0 → 1; curve `shape` is (1 − p)^power, ½(1 + cos πp), 1 − √p or 1;
    - final_fraction from total_steps on.

    power 1 is BERT's linear decay; shape "constant" (or power 0) is warm-up then constant."""

    warmup_steps: int
    total_steps: int
    power: float = 1.0
    final_fraction: float = 0.0
    shape: str = "polynomial"
    decay_fraction: float = 1.0

    def __post_init__(self) -> None:
        for name in ("warmup_steps", "total_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}: expected a non-negative integer, got {value!r}")
        if self.total_steps < 1 or self.total_steps < self.warmup_steps:
            raise ValueError(
                f"total_steps: expected >= 1 and >= warmup_steps ({self.warmup_steps}), got {self.total_steps}"
            )
        for name in ("power", "final_fraction", "decay_fraction"):
            if not isinstance(getattr(self, name), (int, float)) or isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected a number, got {getattr(self, name)!r}")
        if not self.power >= 0.0:
            raise ValueError(f"power: expected >= 0, got {self.power!r}")
        if not 0.0 <= self.final_fraction <= 1.0:
            raise ValueError(f"final_fraction: expected a number in [0, 1], got {self.final_fraction!r}")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ValueError(f"decay_fraction: expected a number in (0, 1], got {self.decay_fraction!r}")
        if self.shape not in CURVES:
            raise ValueError(f"shape: expected one of {', '.join(CURVES)}, got {self.shape!r}")

    @property
    def decay_start(self) -> int:
        """The first step of the decay (the last of the hold at rate 1 is one before it)."""
        return max(self.warmup_steps, self.total_steps - round(self.decay_fraction * self.total_steps))

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return step / self.warmup_steps
        if self.shape == "constant":
            return 1.0
        if step >= self.total_steps:
            return self.final_fraction
        start = self.decay_start
        if step < start:
            return 1.0
        progress = (step - start) / (self.total_steps - start)
        return self.final_fraction + (1.0 - self.final_fraction) * CURVES[self.shape](progress, self.power)


def warmup_decay(
    optimizer: torch.optim.Optimizer,
    warmup_steps: int,
    total_steps: int,
    power: float = 1.0,
    final_fraction: float = 0.0,
    position: int = 0,
    shape: str = "polynomial",
    decay_fraction: float = 1.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR with the WarmupDecay multiplier for every parameter group; call its step() after
    each optimizer step. Its state_dict round-trips the schedule's settings. `position`: the
    optimizer steps already taken (a resumed run; its groups keep their base rate as
    `initial_lr`, as a scheduler's optimizer state does): the rates start there."""
    schedule = WarmupDecay(warmup_steps, total_steps, power, final_fraction, shape, decay_fraction)
    if position:
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule, last_epoch=position - 1)
