"""Shampoo's declaration: its run-file section, its task rules and where its torch parts live. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pipefisher.core.settings import ConfigError
from pipefisher.methods.method import CurvatureMethod, TaskRules
from pipefisher.methods.settings import RefreshConfig


@dataclass(frozen=True)
class ShampooConfig(RefreshConfig):
    """Shampoo settings (used with optimizer.name shampoo; `pipefisher.methods.shampoo`): statistics decay
    `beta2` (1 = plain sum), `epsilon` added before the inverse 4th root, `block_size` (longer
    dimensions are cut into blocks), `root` method, `grafting` (adam takes optimizer.betas[1] and
    optimizer.eps), `start_step` (steps before it use the grafting direction alone),
    `statistics_dtype` (float64: a statistic GGᵀ squares the gradient's condition number, which
    float32 resolves only to about 1e-7 of its largest eigenvalue); the statistics come from the
    gradient of every refresh cycle's first step. Placement keys as `RefreshConfig`."""

    beta2: float = 1.0
    epsilon: float = 1e-12
    block_size: int = 1024
    root: Literal["eigen", "newton"] = "eigen"
    grafting: Literal["adam", "sgd", "none"] = "adam"
    start_step: int = 0
    statistics_dtype: Literal["float64", "float32"] = "float64"

    def check(self, name: str, config: Any) -> None:
        super().check(name, config)
        for key in ("epsilon", "block_size"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"{name}.{key}: {getattr(self, key):g} must be positive")
        if not 0 < self.beta2 <= 1:
            raise ConfigError(f"{name}.beta2: {self.beta2} must be in (0, 1] (1 = a plain sum of the statistics)")
        if self.start_step < 0:
            raise ConfigError(f"{name}.start_step: {self.start_step} must be >= 0")


#: Shampoo's statistics need the stage's whole gradient: one sync (named A) carries it to both factors
SHAMPOO = CurvatureMethod(
    name="shampoo", label="Shampoo",
    rules=TaskRules(curvature=False, syncs=("A",), sync_of=(("A", "A"), ("B", "A")), precondition=False),
    settings=ShampooConfig, parts="pipefisher.methods.shampoo.parts:PARTS",
)
