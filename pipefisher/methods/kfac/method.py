"""K-FAC's declaration: its run-file section, its task rules and where its torch parts live. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pipefisher.core.settings import ConfigError
from pipefisher.methods.method import CurvatureMethod, TaskRules
from pipefisher.methods.settings import RefreshConfig
from pipefisher.planning.layouts.kaisa import worker_count


@dataclass(frozen=True)
class KfacConfig(RefreshConfig):
    """K-FAC settings (used with optimizer.name kfac): `damping` (added to each factor before
    inversion), `factor_decay` (EMA decay of the factors), `inverse` method;
    `grad_worker_fraction` f (KAISA, `pipefisher.planning.layouts.kaisa`): each layer's inverses
    live on f of a stage's replicas, which precondition its reduced gradient and broadcast it to
    the others (1 = every replica keeps every inverse and preconditions before the reduction);
    placement keys as `RefreshConfig`."""

    damping: float = 1e-3
    factor_decay: float = 0.95
    inverse: Literal["eigen", "cholesky"] = "eigen"
    grad_worker_fraction: float = 1.0

    def check(self, name: str, config: Any) -> None:
        super().check(name, config)
        if not self.damping > 0:
            raise ConfigError(f"{name}.damping: {self.damping:g} must be positive")
        if not 0 <= self.factor_decay < 1:
            raise ConfigError(f"{name}.factor_decay: {self.factor_decay} must be in [0, 1)")
        if config.optimizer.name != name:
            return
        try:
            workers = worker_count(config.stage_replicas, self.grad_worker_fraction)
        except ValueError as exc:
            raise ConfigError(f"{name}.grad_worker_fraction: {exc}") from None
        if workers < config.stage_replicas and config.optimizer.zero:
            raise ConfigError(f"{name}.grad_worker_fraction: gradient workers need every replica's reduced gradient, ZeRO-1 "
                              f"reduces to owners; use {name}.grad_worker_fraction 1 or optimizer.zero 0")

    def gradient_workers(self, replicas: int) -> int:
        return worker_count(replicas, self.grad_worker_fraction)


KFAC = CurvatureMethod(
    name="kfac", label="K-FAC",
    rules=TaskRules(curvature=True, syncs=("A", "B"), sync_of=(("A", "A"), ("B", "B")), precondition=True),
    settings=KfacConfig, parts="pipefisher.methods.kfac.parts:PARTS", flags=("grad_worker_fraction",),
    memory="pipefisher.methods.kfac.memory:KfacLayer",
)
