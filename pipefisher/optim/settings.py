"""The run file's `optimizer` section: the first-order rule, its learning-rate schedule and ZeRO,
each key declared once. Pure Python: no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pipefisher.core.settings import STEP_CEILING, setting


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
    decay: Literal["constant", "linear"] = setting("constant", "after warm-up: constant, or linear to 0 at decay_steps")
    decay_steps: int = setting(
        0,
        "step at which linear decay reaches 0 (0 = the run's last step; fix it when --resume splits a run)",
        low=0,
        ceiling=STEP_CEILING,
    )
    zero: int = setting(
        0,
        "ZeRO stage: 1 shards the optimizer state over each stage's replicas (its owner updates and broadcasts each parameter)",
        low=0,
        high=1,
        note="0 = off, 1 = the optimizer state sharded over each stage's replicas",
    )
