"""The run file's `optimizer` section: the first-order rule, its learning-rate schedule and ZeRO,
each key declared once. Pure Python: no torch."""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import fields
from typing import Literal

from pipefisher.core.settings import STEP_CEILING, ConfigError, setting

#: schedule key -> the values of `decay` that read it; set to other than its default under another
#: decay, it is refused (it would be ignored in silence)
DECAY_READS: dict[str, tuple[str, ...]] = {
    "min_lr_fraction": ("linear", "polynomial", "cosine", "wsd"),
    "decay_power": ("polynomial",),
    "decay_fraction": ("wsd",),
    "wsd_shape": ("wsd",),
}


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer; a curvature method preconditions, then SGD steps what it preconditions and
    its section's `first_order` rule the rest (weight decay skips biases and LayerNorm weights)."""

    name: str = setting("sgd", "sgd, adamw, lamb, or a curvature method (its section holds its settings)")
    lr: float = setting(
        0.05,
        "learning rate after warm-up (a curvature method's: its section's lr unless 0; see its first_order)",
        low=0,
        low_open=True,
    )
    momentum: float = setting(0.0, "SGD momentum", low=0, high=1, high_open=True)
    weight_decay: float = setting(0.0, "decoupled weight decay (0 = off)", low=0)
    betas: tuple[float, float] = setting(
        (0.9, 0.999),
        "AdamW/LAMB moment decays (also read by a curvature method's Adam grafting)",
        low=0,
        high=1,
        high_open=True,
    )
    eps: float = setting(1e-8, "AdamW/LAMB epsilon", low=0, low_open=True)
    clip_norm: float = setting(0.0, "clip the global gradient norm, after preconditioning (0 = off)", low=0)
    warmup_steps: int = setting(0, "steps of linear warm-up", low=0, ceiling=STEP_CEILING)
    decay: Literal["constant", "linear", "polynomial", "cosine", "wsd"] = setting(
        "constant",
        "after warm-up: constant; linear, polynomial (decay_power) or cosine to min_lr_fraction at decay_steps; "
        "wsd: constant, then a wsd_shape decay over the last decay_fraction of the steps",
    )
    decay_steps: int = setting(
        0,
        "step at which the decay reaches min_lr_fraction (0 = the run's last step; fix it when --resume splits a run)",
        low=0,
        ceiling=STEP_CEILING,
    )
    min_lr_fraction: float = setting(
        0.0, "the decay's floor, a fraction of the rate (kept from decay_steps on)", low=0, high=1
    )
    decay_power: float = setting(1.0, "decay polynomial: the exponent of (1 - progress) (1 = linear)", low=0)
    decay_fraction: float = setting(
        0.2,
        "decay wsd: the share of decay_steps (or the run's steps) the final decay spans",
        low=0,
        low_open=True,
        high=1,
    )
    wsd_shape: Literal["linear", "cosine", "sqrt"] = setting(
        "linear", "decay wsd: the final decay's curve: linear, cosine, or sqrt (1 - sqrt(progress))"
    )
    zero: int = setting(
        0,
        "ZeRO stage over each stage's replicas: 1 shards the optimizer state (its owner updates and broadcasts each "
        "parameter); 2 also the gradients, 3 also the parameters (PyTorch's FSDP2, first-order rules only)",
        low=0,
        high=3,
        note="0 = off, 1 = the optimizer state sharded, 2 = + gradients (FSDP2), 3 = + parameters (FSDP2)",
    )

    def __post_init__(self) -> None:
        """ConfigError for a schedule key set under a `decay` that does not read it."""
        defaults = {field.name: field.default for field in fields(self)}
        for key, readers in DECAY_READS.items():
            if self.decay not in readers and getattr(self, key) != defaults[key]:
                raise ConfigError(
                    f"optimizer.{key}: read by optimizer.decay {' or '.join(readers)}; this run's decay is "
                    f"{self.decay}; drop {key} or change decay"
                )
