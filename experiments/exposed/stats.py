"""The paired statistics and markdown tables of experiments/bench_exposed.py.

A `Pair` holds, per repeat, the first-order run's and one method's run's mean step time [ms]
over the same whole refresh cycles (the two ran in the same repeat). Its ratio per repeat is
method / first-order; the table gives their median and a 95 % t-interval of their geometric mean
(mean of the log ratios ± t(0.975, n − 1) × their standard error, exponentiated): the exposed
share is ratio − 1.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field

#: two-sided 95 % quantiles of Student's t for 1..30 degrees of freedom
T_975 = tuple(
    float(t)
    for t in (
        "12.706 4.303 3.182 2.776 2.571 2.447 2.365 2.306 2.262 2.228 2.201 2.179 2.160 2.145 2.131 "
        "2.120 2.110 2.101 2.093 2.086 2.080 2.074 2.069 2.064 2.060 2.056 2.052 2.048 2.045 2.042"
    ).split()
)


def t_975(df: int) -> float:
    """Student's t 97.5 % quantile for `df` ≥ 1 degrees of freedom (above 30: the next table row
    down, 2.000 to 60, 1.980 to 120, then 1.960: slightly wide, never narrow)."""
    if df < 1:
        raise ValueError(f"degrees of freedom {df}: need at least 1")
    if df <= len(T_975):
        return T_975[df - 1]
    return 2.000 if df <= 60 else 1.980 if df <= 120 else 1.960


@dataclass(frozen=True)
class Interval:
    """A 95 % interval of a ratio around its geometric mean `centre`."""

    centre: float
    low: float
    high: float


def log_ratio_interval(ratios: list[float]) -> Interval | None:
    """The geometric mean of `ratios` (all > 0) and its 95 % t-interval; None with fewer than 2."""
    if len(ratios) < 2:
        return None
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    half = t_975(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return Interval(math.exp(mean), math.exp(mean - half), math.exp(mean + half))


@dataclass
class Pair:
    """One method against the first-order run of the same layout (`schedule`): per repeat, both
    runs' mean step time [ms] over the method run's whole refresh cycles, and its interval k."""

    schedule: str
    method: str
    label: str
    first_order_ms: list[float] = field(default_factory=list)
    method_ms: list[float] = field(default_factory=list)
    refresh_steps: list[int] = field(default_factory=list)

    @property
    def ratios(self) -> list[float]:
        """Per repeat: method step time / first-order step time."""
        return [m / f for m, f in zip(self.method_ms, self.first_order_ms)]

    @property
    def ratio(self) -> float:
        """Median over repeats of the paired ratios."""
        return statistics.median(self.ratios)

    @property
    def interval(self) -> Interval | None:
        return log_ratio_interval(self.ratios)

    def as_dict(self) -> dict:
        interval = self.interval
        return {
            **asdict(self),
            "ratios": self.ratios,
            "ratio_median": self.ratio,
            "geometric_mean": interval.centre if interval else None,
            "ci95": [interval.low, interval.high] if interval else None,
        }


def _percent(ratio: float) -> str:
    return f"{100 * (ratio - 1):+.1f} %"


def _ks(values: list[int]) -> str:
    return ", ".join(str(k) for k in sorted(set(values)))


def ratio_table(pairs: list[Pair]) -> str:
    """Schedule × method: both arms' median step times, the ratio and the exposed share."""
    lines = [
        "| schedule | method | k | first-order ms/step | method ms/step | ratio: median of paired "
        "(geometric mean [95 % CI]) | exposed: median (95 % CI upper end) |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in pairs:
        interval = p.interval
        spread = f" ({interval.centre:.3f} [{interval.low:.3f}, {interval.high:.3f}])" if interval else " (one repeat)"
        upper = f" ({_percent(interval.high)})" if interval else ""
        lines.append(
            f"| {p.schedule} | {p.label} | {_ks(p.refresh_steps)} | {statistics.median(p.first_order_ms):.1f} | "
            f"{statistics.median(p.method_ms):.1f} | {p.ratio:.3f}{spread} | {_percent(p.ratio)}{upper} |"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class RankTime:
    """One rank's traced steps, per step [ms]: its step time, the time in the executor's waits
    (`idle`: for a message, a collective or the step's world reduction) and the rest (`busy`)."""

    rank: int
    step_ms: float
    idle_ms: float

    @property
    def busy_ms(self) -> float:
        return self.step_ms - self.idle_ms


@dataclass(frozen=True)
class Traced:
    """The traced steps of one arm (`label`) of a schedule: one `RankTime` per rank."""

    schedule: str
    label: str
    steps: int
    ranks: tuple[RankTime, ...]


def trace_table(traced: list[Traced]) -> str:
    """Schedule × arm: per rank, busy and idle ms per traced step (and idle's share)."""
    ranks = max((len(t.ranks) for t in traced), default=0)
    head = " | ".join(f"rank {r} busy / idle ms (idle %)" for r in range(ranks))
    lines = [f"| schedule | arm | traced steps | {head} |", "|---|---|---|" + "---|" * ranks]
    for t in traced:
        cells = " | ".join(f"{r.busy_ms:.1f} / {r.idle_ms:.1f} ({100 * r.idle_ms / r.step_ms:.0f} %)" for r in t.ranks)
        lines.append(f"| {t.schedule} | {t.label} | {t.steps} | {cells} |")
    return "\n".join(lines)
