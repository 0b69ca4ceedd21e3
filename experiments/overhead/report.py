"""One comparison's measurements (`Comparison`: pipefisher against a baseline, paired repeats)
and the markdown table and JSON of a benchmark run."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field


@dataclass
class Comparison:
    """pipefisher against `baseline` on one model and optimizer: per repeat, the seconds each side
    took for `steps` steps of `tokens_per_step` tokens (the two of a repeat ran back to back);
    `first_losses` the first step's loss of each side; `flops_per_step` (model FLOPs, `flops`)
    and `peak` (the devices' summed peak dense bf16 FLOP/s) where MFU applies, else None."""

    model: str
    optimizer: str
    arm: str
    baseline: str
    tokens_per_step: int
    steps: int
    baseline_seconds: list[float] = field(default_factory=list)
    pipefisher_seconds: list[float] = field(default_factory=list)
    first_losses: dict[str, float] = field(default_factory=dict)
    flops_per_step: float | None = None
    peak: float | None = None

    def tokens_per_s(self, seconds: list[float]) -> float:
        """Median over repeats of tokens per second."""
        return statistics.median(self.tokens_per_step * self.steps / s for s in seconds)

    @property
    def ratio(self) -> float:
        """Median over repeats of pipefisher's tokens/s over the baseline's in that repeat (1 = as fast)."""
        return statistics.median(b / p for b, p in zip(self.baseline_seconds, self.pipefisher_seconds))

    def mfu(self, seconds: list[float]) -> float | None:
        """Model FLOPs utilisation at the median tokens/s, or None without FLOPs or a peak."""
        if self.flops_per_step is None or self.peak is None:
            return None
        return self.flops_per_step * self.tokens_per_s(seconds) / self.tokens_per_step / self.peak

    @property
    def loss_difference(self) -> float:
        """Relative difference of the two sides' first-step losses (same model, data, optimizer)."""
        base, pipe = self.first_losses["baseline"], self.first_losses["pipefisher"]
        return abs(pipe - base) / abs(base) if base else math.inf

    def latest(self) -> str:
        """The latest repeat's tokens/s of both sides, as a progress line."""
        rates = (
            self.tokens_per_step * self.steps / seconds[-1]
            for seconds in (self.baseline_seconds, self.pipefisher_seconds)
        )
        return f"{self.model} {self.optimizer} {self.arm}: {self.baseline} {next(rates):,.0f} tokens/s, pipefisher {next(rates):,.0f} tokens/s"

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "baseline_tokens_per_s": self.tokens_per_s(self.baseline_seconds),
            "pipefisher_tokens_per_s": self.tokens_per_s(self.pipefisher_seconds),
            "ratio": self.ratio,
            "baseline_mfu": self.mfu(self.baseline_seconds),
            "pipefisher_mfu": self.mfu(self.pipefisher_seconds),
            "first_loss_relative_difference": self.loss_difference,
        }


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f} %"


def table(comparisons: list[Comparison]) -> str:
    """The markdown table: one row per comparison."""
    lines = [
        "| model | optimizer | arm | baseline | baseline tokens/s | pipefisher tokens/s | pipefisher / baseline "
        "(median of paired ratios) | baseline MFU | pipefisher MFU | first-step loss, relative difference |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in comparisons:
        lines.append(
            f"| {c.model} | {c.optimizer} | {c.arm} | {c.baseline} | {c.tokens_per_s(c.baseline_seconds):,.0f} | "
            f"{c.tokens_per_s(c.pipefisher_seconds):,.0f} | {c.ratio:.3f} | {_percent(c.mfu(c.baseline_seconds))} | "
            f"{_percent(c.mfu(c.pipefisher_seconds))} | {c.loss_difference:.1e} |"
        )
    return "\n".join(lines)
