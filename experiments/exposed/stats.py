"""The paired statistics and markdown tables of experiments/bench_exposed.py.

A `Pair` holds, per round, the first-order arm's and one method's arm's step time [ms] (each a
timed block of whole refresh cycles in the same round of the same process group) and the cores
other processes of the machine used during each block. Its ratio per round is method /
first-order; the table gives their median and a 95 % t-interval of their geometric mean (mean of
the log ratios ± t(0.975, n − 1) × their standard error, exponentiated): the exposed share is
ratio − 1. The same over the quiet rounds only: those in which other processes used at most
`Pair.quiet_load` cores during both blocks of the pair.

Rounds from several process groups (fresh processes, one after the other: `Pair.round_groups`)
are summarised per group first: the interval is then Student's t over the groups' mean log
ratios (`grouped_interval`), so it also covers what stays fixed within one group and moves
between groups (where each arm's tensors lie in memory, the machine's state of that hour), which
the rounds of one group cannot show.
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


def grouped_interval(ratios: list[float], groups: list[int]) -> Interval | None:
    """With `ratios` from 2 or more process groups (`groups[i]`: the group of ratio i): the
    geometric mean of the groups' geometric means and its 95 % t-interval over them (one value
    per group, df = groups − 1); with one group, `log_ratio_interval` of the ratios."""
    by_group: dict[int, list[float]] = {}
    for ratio, group in zip(ratios, groups, strict=True):
        by_group.setdefault(group, []).append(math.log(ratio))
    if len(by_group) < 2:
        return log_ratio_interval(ratios)
    return log_ratio_interval([math.exp(statistics.fmean(logs)) for logs in by_group.values()])


@dataclass
class Pair:
    """One method against the first-order arm of the same group (`schedule`): per round, both
    arms' step time [ms] (block wall time of the slower rank / its steps) and the cores other
    processes used during each block; the method's refresh interval `k`; the run's own estimate
    of its exposed share (`pipefisher run`'s `exposed_share`, from its op times; None: none).
    From several process groups (`merged`): per round its group's number, per group its k and
    its own estimate."""

    schedule: str
    method: str
    label: str
    k: int
    quiet_load: float
    first_order_ms: list[float] = field(default_factory=list)
    method_ms: list[float] = field(default_factory=list)
    first_order_load: list[float] = field(default_factory=list)
    method_load: list[float] = field(default_factory=list)
    own_estimate: float | None = None
    round_groups: list[int] = field(default_factory=list)
    group_ks: list[int] = field(default_factory=list)
    group_estimates: list[float | None] = field(default_factory=list)

    @classmethod
    def merged(cls, groups: list[Pair]) -> Pair:
        """One pair of the rounds of `groups` (the same method and schedule, one pair per process
        group, in order); its k and own estimate are the first group's."""
        first = groups[0]
        return cls(
            first.schedule,
            first.method,
            first.label,
            first.k,
            first.quiet_load,
            [ms for p in groups for ms in p.first_order_ms],
            [ms for p in groups for ms in p.method_ms],
            [load for p in groups for load in p.first_order_load],
            [load for p in groups for load in p.method_load],
            first.own_estimate,
            [number for number, p in enumerate(groups) for _ in p.method_ms],
            [p.k for p in groups],
            [p.own_estimate for p in groups],
        )

    @property
    def groups(self) -> list[int]:
        """Per round, its process group (all 0 from one group)."""
        return self.round_groups or [0] * len(self.method_ms)

    @property
    def ratios(self) -> list[float]:
        """Per round: method step time / first-order step time."""
        return [m / f for m, f in zip(self.method_ms, self.first_order_ms)]

    @property
    def quiet_ratios(self) -> list[float]:
        """The ratios of the rounds in which both blocks were quiet."""
        return [self.ratios[i] for i in self._quiet_rounds()]

    @property
    def quiet_groups(self) -> list[int]:
        """The process group of each quiet round."""
        return [self.groups[i] for i in self._quiet_rounds()]

    def _quiet_rounds(self) -> list[int]:
        loads = zip(self.first_order_load, self.method_load)
        return [i for i, (a, b) in enumerate(loads) if max(a, b) <= self.quiet_load]

    @property
    def ratio(self) -> float:
        """Median over rounds of the paired ratios."""
        return statistics.median(self.ratios)

    @property
    def interval(self) -> Interval | None:
        return grouped_interval(self.ratios, self.groups)

    def as_dict(self) -> dict:
        def summary(ratios: list[float], groups: list[int]) -> dict:
            interval = grouped_interval(ratios, groups)
            return {
                "rounds": len(ratios),
                "ratio_median": statistics.median(ratios) if ratios else None,
                "geometric_mean": interval.centre if interval else None,
                "ci95": [interval.low, interval.high] if interval else None,
            }

        return {
            **asdict(self),
            "ratios": self.ratios,
            "all": summary(self.ratios, self.groups),
            "quiet": summary(self.quiet_ratios, self.quiet_groups),
        }


def _percent(ratio: float) -> str:
    return f"{100 * (ratio - 1):+.1f} %"


def _summary(ratios: list[float], groups: list[int]) -> str:
    """'median (geometric mean [95 % CI])' of `ratios` (from process `groups`), or a dash with none."""
    if not ratios:
        return "–"
    interval = grouped_interval(ratios, groups)
    spread = f" ({interval.centre:.3f} [{interval.low:.3f}, {interval.high:.3f}])" if interval else " (one round)"
    return f"{statistics.median(ratios):.3f}{spread}"


def _exposed(ratios: list[float], groups: list[int]) -> str:
    """'median (95 % CI upper end)' of the exposed share ratio − 1."""
    if not ratios:
        return "–"
    interval = grouped_interval(ratios, groups)
    return _percent(statistics.median(ratios)) + (f" ({_percent(interval.high)})" if interval else "")


def _per_group(p: Pair) -> str:
    """Each process group's median exposed share, in order."""
    by_group: dict[int, list[float]] = {}
    for ratio, group in zip(p.ratios, p.groups):
        by_group.setdefault(group, []).append(ratio)
    return ", ".join(_percent(statistics.median(ratios)) for ratios in by_group.values())


def ratio_table(pairs: list[Pair]) -> str:
    """Schedule × method: both arms' median step times, the ratio and the exposed share over all
    rounds and over the quiet ones, and the run's own estimate; from several process groups, the
    intervals over the groups and each group's median exposed share."""
    grouped = any(len(set(p.groups)) > 1 for p in pairs)
    over = " over groups" if grouped else ""
    lines = [
        "| schedule | method | k | first-order ms/step | method ms/step | ratio: median of paired "
        f"(geometric mean [95 % CI{over}]) | exposed: median (95 % CI{over} upper end) | quiet rounds | "
        "quiet: ratio | quiet: exposed | the run's own estimate |"
        + (" exposed per group: median |" if grouped else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if grouped else ""),
    ]
    for p in pairs:
        quiet, quiet_groups = p.quiet_ratios, p.quiet_groups
        estimates = [e for e in p.group_estimates or [p.own_estimate] if e is not None]
        own = ", ".join(f"{100 * e:+.1f} %" for e in estimates) or "–"
        k = ", ".join(str(k) for k in sorted(set(p.group_ks))) if p.group_ks else str(p.k)
        lines.append(
            f"| {p.schedule} | {p.label} | {k} | {statistics.median(p.first_order_ms):.1f} | "
            f"{statistics.median(p.method_ms):.1f} | {_summary(p.ratios, p.groups)} | {_exposed(p.ratios, p.groups)} | "
            f"{len(quiet)} of {len(p.ratios)} | {_summary(quiet, quiet_groups)} | {_exposed(quiet, quiet_groups)} | "
            f"{own} |" + (f" {_per_group(p)} |" if grouped else "")
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class RankTime:
    """One rank's recorded block (whole refresh cycles), per step [ms]: its wall time (`step_ms`), the time in its
    ops (`ops_ms`: forward, backward, the method's tasks), in the end of step (`end_ms`: after its
    last op: the optimizer step, the gradient and loss reductions, the next step's batches, the
    runner's end of a cycle) and
    the rest (`wait_ms`): waits between ops, for the other stage's messages or a collective;
    `compute_ms`: the part of `ops_ms` in forwards, backwards and weight gradients."""

    rank: int
    step_ms: float
    ops_ms: float
    end_ms: float
    compute_ms: float = 0.0

    @property
    def wait_ms(self) -> float:
        return max(0.0, self.step_ms - self.ops_ms - self.end_ms)


@dataclass(frozen=True)
class Traced:
    """The recorded block of one arm (`label`) of a schedule: `steps` steps, one `RankTime` per rank."""

    schedule: str
    label: str
    steps: int
    ranks: tuple[RankTime, ...]

    def as_dict(self) -> dict:
        return {**asdict(self), "ranks": [{**asdict(r), "wait_ms": r.wait_ms} for r in self.ranks]}


def trace_table(traced: list[Traced]) -> str:
    """Schedule × arm: per rank, ms per step in ops (of them in forwards, backwards and weight
    gradients, and that compute against the first-order arm's, the first of each schedule: on a
    CPU the method's work on one core can slow the other core's compute) / end of step / waits (and
    the waits' share)."""
    ranks = max((len(t.ranks) for t in traced), default=0)
    head = " | ".join(
        f"rank {r} ops (compute, vs first-order) / end of step / waits ms (waits %)" for r in range(ranks)
    )
    lines = [f"| schedule | arm | recorded steps | {head} |", "|---|---|---|" + "---|" * ranks]
    first: dict[str, Traced] = {}
    for t in traced:
        base = first.setdefault(t.schedule, t)
        cells = " | ".join(
            f"{r.ops_ms:.1f} ({r.compute_ms:.1f}, {_change(r.compute_ms, b.compute_ms)}) / {r.end_ms:.1f} / "
            f"{r.wait_ms:.1f} ({100 * r.wait_ms / r.step_ms:.0f} %)"
            for r, b in zip(t.ranks, base.ranks)
        )
        lines.append(f"| {t.schedule} | {t.label} | {t.steps} | {cells} |")
    return "\n".join(lines)


def _change(value: float, base: float) -> str:
    return f"{100 * (value / base - 1):+.1f} %" if base else "–"
