"""The time-to-target study's measures and outputs: steps and measured seconds to a target
held-out loss, the consistency check of the two, the markdown table, the CSV of every evaluation
and the figure."""

from __future__ import annotations

import csv
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from experiments.convergence_study.report import first_crossing
from experiments.convergence_study.runs import FIRST_ORDER, WORKLOADS
from experiments.time_to_target_study.runs import PipelinedRun, Setting

#: |seconds to target / (steps to target x median step) - 1| above which the check flags a method
TOLERANCE = 0.10


def final(run: PipelinedRun) -> float:
    """The held-out loss after the last step (inf for a diverged run or one without evaluations)."""
    return run.evals[-1][1] if run.evals and math.isfinite(run.evals[-1][1]) else math.inf


def steps_to(run: PipelinedRun, target: float) -> float:
    """Steps at which the held-out loss first reaches `target` (linear between evaluations; inf: never)."""
    return first_crossing([(float(step), loss) for step, loss in run.evals], target)


def seconds_to(run: PipelinedRun, target: float) -> float:
    """Measured training seconds at which the held-out loss first reaches `target` (the sum of the
    step times up to there, linear between evaluations; inf: never)."""
    return first_crossing(run.clock, target)


def disagreement(seconds: float, steps: float, step_ms: float) -> float:
    """seconds / (steps x step_ms / 1000) - 1: how far measured seconds to target are from steps to
    target at the median step time (nan when either is not finite)."""
    product = steps * step_ms / 1000
    if not (math.isfinite(seconds) and math.isfinite(product)) or product <= 0:
        return math.nan
    return seconds / product - 1


def flagged(seconds: float, steps: float, step_ms: float, tolerance: float = TOLERANCE) -> bool:
    """Whether the consistency check fails: a disagreement beyond `tolerance`, or one of seconds and
    steps to target finite and the other not."""
    if math.isfinite(seconds) != math.isfinite(steps):
        return True
    off = disagreement(seconds, steps, step_ms)
    return not math.isnan(off) and abs(off) > tolerance


def apart(mine: list[float], adamw: list[float]) -> bool:
    """Whether every one of a method's seeds reached the target before any of AdamW's did (steps
    or seconds; inf: never): the seeds do not overlap."""
    return bool(mine and adamw) and max(mine) < min(adamw)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


@dataclass(frozen=True)
class Arm:
    """A method on a schedule: its tuned setting (seed 0) and its runs at it, seeds 0.."""

    tuned: Setting
    runs: list[PipelinedRun]

    @property
    def label(self) -> str:
        return f"{self.tuned.method} {self.tuned.schedule}"

    def steps(self, target: float) -> list[float]:
        return [steps_to(run, target) for run in self.runs]

    def seconds(self, target: float) -> list[float]:
        return [seconds_to(run, target) for run in self.runs]

    def step_ms(self) -> float:
        """Median over the seeds of each run's median step [ms]."""
        return _median([run.median_step_ms for run in self.runs])

    def exposed(self) -> float:
        """Median over the seeds of the runs' own exposed optimizer time share (nan: none measured)."""
        return _median([run.exposed_share for run in self.runs if run.exposed_share is not None])

    def final(self) -> float:
        return _median([final(run) for run in self.runs])

    def curve(self, clock: bool) -> tuple[list[float], list[float]]:
        """(steps or seconds, median held-out loss over the seeds at each evaluation); the x of the
        seconds curve is the median over the seeds too."""
        points = [run.clock if clock else [(float(s), v) for s, v in run.evals] for run in self.runs]
        count = min(len(p) for p in points)
        return (
            [_median([p[i][0] for p in points]) for i in range(count)],
            [_median([p[i][1] for p in points]) for i in range(count)],
        )


def _num(value: float, digits: str) -> str:
    if math.isnan(value):
        return "n/a"
    return "not reached" if math.isinf(value) else format(value, digits)


def _ratio(value: float, base: float) -> str:
    ok = all(math.isfinite(v) for v in (value, base)) and base > 0
    return f"{value / base:.2f}" if ok else "–"


def results_table(arms: list[Arm], target: float) -> list[str]:
    """Markdown rows, one per method and schedule, ratios against AdamW on the same schedule."""
    base = {arm.tuned.schedule: arm for arm in arms if arm.tuned.method == "adamw"}
    rows = [
        "| method | schedule | tuned lr | held-out loss at the end (median) | steps to target, median (per seed) | × AdamW | "
        "seconds to target [s], median (per seed) | × AdamW | median step [ms] | × AdamW | exposed optimizer time (run's own) | "
        "seeds apart from AdamW's (steps / s) | steps × step [s] | check |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm in arms:
        ref = base.get(arm.tuned.schedule)
        steps, seconds, step_ms = _median(arm.steps(target)), _median(arm.seconds(target)), arm.step_ms()
        off = disagreement(seconds, steps, step_ms)
        check = f"{'FLAG' if flagged(seconds, steps, step_ms) else 'ok'} ({_num(100 * off, '+.0f')} %)"
        lr = f"{arm.tuned.lr:g}"
        separate = "–"
        if ref and arm is not ref:
            separate = " / ".join(
                "yes" if apart(mine, theirs) else "no"
                for mine, theirs in ((arm.steps(target), ref.steps(target)), (arm.seconds(target), ref.seconds(target)))
            )
        if arm.tuned.method not in FIRST_ORDER:
            ks = "/".join(str(k) for k in sorted({run.k for run in arm.runs}))
            lr += f", k {ks}, AdamW {arm.tuned.base_lr:g} for the rest"
        rows.append(
            f"| {arm.tuned.method} | {arm.tuned.schedule} | {lr} | {arm.final():.3f} | "
            f"{_num(steps, '.0f')} ({', '.join(_num(s, '.0f') for s in arm.steps(target))}) | "
            f"{_ratio(steps, _median(ref.steps(target))) if ref else '–'} | "
            f"{_num(seconds, '.1f')} ({', '.join(_num(s, '.1f') for s in arm.seconds(target))}) | "
            f"{_ratio(seconds, _median(ref.seconds(target))) if ref else '–'} | {step_ms:.1f} | "
            f"{_ratio(step_ms, ref.step_ms()) if ref else '–'} | {_num(100 * arm.exposed(), '+.1f')}{'' if math.isnan(arm.exposed()) else ' %'} | "
            f"{separate} | {_num(steps * step_ms / 1000, '.1f')} | {check} |"
        )
    return rows


def grid_table(grid: dict[Setting, PipelinedRun], target: float) -> list[str]:
    """Markdown rows of the seed-0 grids: setting, final held-out loss, steps and seconds to target."""
    rows = ["| method | lr | held-out loss at the end | steps to target | seconds to target |", "|---|---|---|---|---|"]
    for setting, run in grid.items():
        rows.append(
            f"| {setting.method} | {setting.lr:g} | {final(run):.3f} | {_num(steps_to(run, target), '.0f')} | "
            f"{_num(seconds_to(run, target), '.1f')} |"
        )
    return rows


def write_csv(path: Path, runs: dict[Setting, PipelinedRun]) -> None:
    """Every evaluation of every run: its setting, step, training seconds before it, held-out loss."""
    with open(path, "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(
            ["workload", "schedule", "method", "lr", "adamw_lr", "seed", "step", "seconds", "held_out_loss"]
        )
        for s, run in runs.items():
            for (step, loss), (seconds, _) in zip(run.evals, run.clock):
                row = [s.workload, s.schedule, s.method, s.lr, s.base_lr or "", s.seed, step, f"{seconds:.3f}"]
                writer.writerow([*row, f"{loss:.5f}"])


def plot(path: Path, per_workload: dict[str, tuple[list[Arm], float]]) -> None:
    """Median held-out loss vs step and vs measured training seconds, one row per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(per_workload), 2, figsize=(12, 4.2 * len(per_workload)), squeeze=False)
    for row, (workload, (arms, target)) in zip(axes, per_workload.items()):
        for arm in arms:
            style = "-" if arm.tuned.schedule == "1f1b" else "--"
            for ax, clock in zip(row, (False, True)):
                ax.plot(*arm.curve(clock), style, marker=".", label=arm.label)
        xlabels = ("step", "measured training clock (train_s: steps only, 2 stages, packed) [s]")
        for ax, xlabel in zip(row, xlabels):
            ax.axhline(target, color="gray", linestyle=":", linewidth=1, label=f"target {target:.3f} (AdamW's final)")
            ax.set_xlabel(xlabel)
            ax.set_ylabel("held-out loss (median of seeds)")
            ax.set_title(WORKLOADS[workload].label)
            if math.isfinite(target):
                ax.set_ylim(target - 1.0, target + 2.0)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
