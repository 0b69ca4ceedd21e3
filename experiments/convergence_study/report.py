"""The convergence study's measures and outputs: steps to a target held-out loss, the markdown
tables, the CSV of every evaluation and the figure."""

from __future__ import annotations

import csv
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from experiments.convergence_study.runs import FIRST_ORDER, WORKLOADS, RunResult, Setting
from experiments.convergence_study.timing import StepTime


def final(result: RunResult) -> float:
    """The held-out loss after the last step (inf for a diverged run)."""
    value = result.evals[-1][1]
    return value if math.isfinite(value) else math.inf


def first_crossing(points: list[tuple[float, float]], target: float) -> float:
    """x at which the curve [(x, loss)] first reaches `target`, linear between the points that
    bracket the crossing; inf when it never does (x: steps, seconds, ...)."""
    previous = None
    for x, loss in points:
        if math.isfinite(loss) and loss <= target:
            if previous is None:
                return float(x)
            (x0, _), share = previous, (previous[1] - target) / (previous[1] - loss)
            return x0 + share * (x - x0)
        previous = (x, loss)
    return math.inf


def steps_to(result: RunResult, target: float) -> float:
    """Steps at which the held-out loss first reaches `target` (`first_crossing` of its evaluations)."""
    return first_crossing([(float(step), loss) for step, loss in result.evals], target)


@dataclass(frozen=True)
class MethodResult:
    """A method's tuned runs (seeds 0..) on one workload and its step times."""

    method: str
    tuned: Setting
    runs: list[RunResult]
    times: StepTime | None

    def steps(self, target: float) -> list[float]:
        return [steps_to(run, target) for run in self.runs]

    def median_steps(self, target: float) -> float:
        return statistics.median(self.steps(target))

    def final(self) -> float:
        return statistics.median(final(run) for run in self.runs)

    def curve(self) -> tuple[list[int], list[float]]:
        """(steps, median held-out loss over the seeds at each evaluation)."""
        steps = [step for step, _ in self.runs[0].evals]
        return steps, [statistics.median(run.evals[i][1] for run in self.runs) for i in range(len(steps))]


def _num(value: float, digits: str = "g") -> str:
    return "not reached" if math.isinf(value) else format(value, digits)


def _ratio(value: float, base: float) -> str:
    return "–" if math.isinf(value) or not base or math.isinf(base) else f"{value / base:.2f}"


def setting_text(setting: Setting, times: StepTime | None) -> str:
    if setting.method in FIRST_ORDER:
        return f"lr {setting.lr:g}"
    return f"lr {setting.lr:g}, k {setting.k}, AdamW lr {setting.base_lr:g} for the rest"


def results_table(results: list[MethodResult], target: float) -> list[str]:
    """Markdown rows of the tuned methods against AdamW (the first of `results`)."""
    base = results[0]
    base_steps = base.median_steps(target)
    rows = [
        "| method | tuned setting | held-out loss at the end (median) | steps to target, median (per seed) | × AdamW | "
        "step here [ms] | time to target here [s] | × AdamW | step at paper scale [ms] (k) | time to target at paper scale [s] | × AdamW |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        med = result.median_steps(target)
        per_seed = ", ".join(_num(s, ".0f") for s in result.steps(target))
        times = result.times
        if times is None:
            timing = "| n/a | n/a | | n/a | n/a | |"
        else:
            here, paper = med * times.measured_ms / 1000, med * times.paper_ms / 1000
            base_here = base_steps * base.times.measured_ms / 1000 if base.times else math.inf
            base_paper = base_steps * base.times.paper_ms / 1000 if base.times else math.inf
            paper_k = f" (k {times.paper_k})" if times.paper_k else ""
            timing = (
                f"| {times.measured_ms:.1f} | {_num(here, '.1f')} | {_ratio(here, base_here)} | {times.paper_ms:.0f}{paper_k} | "
                f"{_num(paper, '.1f')} | {_ratio(paper, base_paper)} |"
            )
        rows.append(
            f"| {result.method} | {setting_text(result.tuned, times)} | {result.final():.3f} | {_num(med, '.0f')} ({per_seed}) | "
            f"{_ratio(med, base_steps)} {timing}"
        )
    return rows


def goal_lines(results: list[MethodResult], target: float) -> list[str]:
    """The issue's goal on this workload: the curvature method with the fewest median steps to
    the target against AdamW (the first of `results`): steps <= 0.5x and time <= 0.6x, here
    and at paper scale; and each curvature method's measured step against AdamW's."""
    base, curvature = results[0], [r for r in results if r.method not in FIRST_ORDER]
    if not curvature or base.times is None:
        return ["Goal: no curvature method ran."]
    best = min(curvature, key=lambda r: r.median_steps(target))
    steps = best.median_steps(target) / base.median_steps(target)
    here = steps * best.times.measured_ms / base.times.measured_ms if best.times else math.inf
    paper = steps * best.times.paper_ms / base.times.paper_ms if best.times else math.inf
    met = steps <= 0.5 and here <= 0.6 and paper <= 0.6
    lines = [
        f"Goal (best curvature method {best.method}): steps {steps:.2f}x AdamW's (goal <= 0.5), time {here:.2f}x here and "
        f"{paper:.2f}x at paper scale (goal <= 0.6): {'met' if met else 'not met'}."
    ]
    costs = ", ".join(f"{r.method} {r.times.measured_ms / base.times.measured_ms:.2f}x" for r in curvature if r.times)
    return lines + [f"Measured packed step against AdamW's pipelined step: {costs}."]


def grid_table(grid: dict[Setting, RunResult], target: float) -> list[str]:
    """Markdown rows of the seed-0 grid: setting, final held-out loss, steps to target."""
    rows = ["| method | setting | held-out loss at the end | steps to target |", "|---|---|---|---|"]
    for setting, result in grid.items():
        rows.append(
            f"| {setting.method} | {setting_text(setting, None)} | {final(result):.3f} | {_num(steps_to(result, target), '.0f')} |"
        )
    return rows


@dataclass(frozen=True)
class Tuning:
    """How a method's lr was tuned: the grid's points run on seed 0 (ascending) and the best."""

    method: str
    lrs: tuple[float, ...]
    best: float

    @property
    def bracketed(self) -> bool:
        """Whether a lower and a higher point than the best were run (the optimum lies between)."""
        return self.lrs[0] < self.best < self.lrs[-1]


def tuning_lines(tunings: list[Tuning]) -> list[str]:
    """Markdown lines saying, per method, which lrs were tried and whether the best is bracketed."""
    lines = ["Tuned: the learning rate only, on seed 0; every other setting is the run file's."]
    for tuning in tunings:
        where = (
            "inside the grid"
            if tuning.bracketed
            else f"at the grid's {'lower' if tuning.best == tuning.lrs[0] else 'upper'} edge: not bracketed"
        )
        points = ", ".join(f"{lr:.3g}" for lr in tuning.lrs)
        lines.append(f"- {tuning.method}: lr {points}; best {tuning.best:.3g}, {where}")
    return lines


def write_csv(path: Path, runs: dict[Setting, RunResult]) -> None:
    """Every evaluation of every run: workload, method, lr, adamw_lr, k, seed, step, held-out loss."""
    with open(path, "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["workload", "method", "lr", "adamw_lr", "k", "seed", "step", "held_out_loss"])
        for setting, result in runs.items():
            for step, loss in result.evals:
                writer.writerow(
                    [
                        setting.workload,
                        setting.method,
                        setting.lr,
                        setting.base_lr or "",
                        setting.k,
                        setting.seed,
                        step,
                        f"{loss:.5f}",
                    ]
                )


def plot(path: Path, per_workload: dict[str, tuple[list[MethodResult], float]]) -> None:
    """Median held-out loss vs step and vs measured time to that step, one row per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(per_workload), 2, figsize=(12, 4.2 * len(per_workload)), squeeze=False)
    for row, (workload, (results, target)) in zip(axes, per_workload.items()):
        for result in results:
            steps, losses = result.curve()
            row[0].plot(steps, losses, marker=".", label=result.method)
            if result.times is not None:
                row[1].plot(
                    [s * result.times.measured_ms / 1000 for s in steps],
                    losses,
                    marker=".",
                    label=f"{result.method}, {result.times.measured_ms:.0f} ms/step",
                )
        for ax, xlabel in zip(
            row, ("step", "time on this CPU, measured pipelined step (2 stages, packed) × steps [s]")
        ):
            ax.axhline(target, color="gray", linestyle="--", linewidth=1, label=f"target {target:.3f} (AdamW's final)")
            ax.set_xlabel(xlabel)
            ax.set_ylabel(f"held-out {WORKLOADS[workload].loss} loss (median of seeds)")
            ax.set_title(WORKLOADS[workload].label)
            ax.set_ylim(target - 1.0, target + 2.0)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
