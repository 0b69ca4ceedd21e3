"""The run-file keys every curvature method's section has: how its refresh work is placed. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pipefisher.core.settings import ConfigError


@dataclass(frozen=True)
class RefreshConfig:
    """How a curvature method's refresh work is placed; the keys every method's section shares.
    `lr` and `momentum`: of the SGD step after preconditioning (0 = optimizer.lr /
    optimizer.momentum), so a run file can carry the method's tuned values beside another
    optimizer's.

    `refresh_steps` 0 lets the packer choose k (at most `max_refresh_steps`, 0 = no cap; see
    `pipefisher.planning.packing.pack` for the rule), packing with the `percentile` of the profile's measured
    samples, `margin` of each bubble kept free, within `max_overhead` (a share of the step), holding
    at most `max_capture_mb` MiB of captures per device (0 = no cap); `placement` packed puts the
    work in the bubbles, after-step runs it in one block after the first step of each cycle;
    `split` spreads the refresh work of a stage over its pipes' replicas and exchanges the results.
    `profile`: a pipefisher.profile/v1 file of this run ("" = measure one before training).
    `plan`: a pipefisher.plan/v1 file of this run (`pipefisher pack -o`) to run as it is instead
    of packing ("" = pack); the profile then only predicts its times.
    Re-profiling: when the measured cycle time differs from the prediction by more than
    `reprofile_threshold` (a share) for `reprofile_patience` cycles in a row, the run measures
    again and re-packs (a steady gap right after a fresh measurement counts as the simulator's
    error, not as drift).
    """

    lr: float = 0.0
    momentum: float = 0.0
    refresh_steps: int = 0
    placement: Literal["packed", "after-step"] = "packed"
    margin: float = 0.0
    percentile: float = 90.0
    max_overhead: float = 0.01
    max_refresh_steps: int = 0
    max_capture_mb: float = 0.0
    split: bool = True
    profile: str = ""
    plan: str = ""
    reprofile_threshold: float = 0.25
    reprofile_patience: int = 3

    def check(self, name: str, config: Any) -> None:
        """ConfigError naming `name`.key for a value out of its range (a method's section adds its
        own keys' checks); `config` is the whole run (`RunConfig`), for keys that depend on other sections."""
        if self.refresh_steps < 0:
            raise ConfigError(f"{name}.refresh_steps: {self.refresh_steps} must be >= 1, or 0 to let the packer choose")
        if self.lr < 0 or not 0 <= self.momentum < 1:
            raise ConfigError(f"{name}.lr must be >= 0 (0 = optimizer.lr) and {name}.momentum in [0, 1) (0 = optimizer.momentum)")
        if not 0 <= self.margin < 1 or self.max_overhead < 0:
            raise ConfigError(f"{name}.margin must be in [0, 1) and {name}.max_overhead >= 0")
        if not 0 < self.percentile <= 100:
            raise ConfigError(f"{name}.percentile: {self.percentile:g} must be in (0, 100] (50 = the median)")
        if self.max_refresh_steps < 0 or self.max_capture_mb < 0:
            raise ConfigError(f"{name}.max_refresh_steps and {name}.max_capture_mb must be >= 0 (0 = no cap)")
        if not self.reprofile_threshold > 0:
            raise ConfigError(f"{name}.reprofile_threshold: {self.reprofile_threshold:g} must be positive")
        if not self.reprofile_patience > 0:
            raise ConfigError(f"{name}.reprofile_patience: {self.reprofile_patience:g} must be positive")

    def gradient_workers(self, replicas: int) -> int:
        """How many of a stage's `replicas` keep each layer's refresh results and precondition its
        reduced gradient (KAISA's gradient workers); every replica unless the method says fewer."""
        return replicas
