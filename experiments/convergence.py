"""Convergence on held-out text: AdamW, LAMB and every registered curvature method (K-FAC,
Shampoo, ...) on the BERT MLM demo and the GPT-2 causal-LM demo; steps and time to AdamW's final
held-out loss.

Every run is `train_reference` (the single-process twin of the pipelined training) of
`schedules/tiny-cpu.yaml` or `schedules/gpt2-tiny-cpu.yaml` with the study's sizes
(`convergence_study.runs.Sizing`: 600 steps, warm-up 30 then linear decay, clipping 1.0, 4
micro-batches of 4 x 32 tokens, vocabulary 2000, 10 % of the documents held out), one thread.
Every 25 steps the loss on 16 fixed micro-batches of the held-out documents (eval mode, no
gradients) is recorded; BERT is judged on its MLM loss, GPT-2 on its LM loss.

1. Step times (`convergence_study.timing`): each method's median step of a short real
   `pipefisher run` here (2 stages, packed, its packer's k, which its runs then use), and the step
   the packer predicts on the BERT-Large Chimera 8 x 8 profile (P100 block times).
2. AdamW on its grid (seed 0), the lowest final held-out loss wins; seeds 1.. at that lr. Target:
   the median over seeds of AdamW's final held-out loss.
3. Every other method on its grid (the lr of AdamW/LAMB, or of the method's section; a curvature
   method gives AdamW at the tuned AdamW lr to what it does not precondition), seed 0; the setting
   with the fewest steps to the target wins (then the lowest final loss); seeds 1.. at it.
   A grid whose best point is at an edge grows past it by the grid's ratio, up to twice; then
   the half-steps either side of the best (x ratio^-1/2, x ratio^1/2) refine it. The report
   lists every method's grid and says whether its best point is bracketed.

Steps to target: first crossing of the held-out curve, linear between evaluations. Time to
target: steps x step time. Writes OUT.png (curves vs step and vs time), OUT.csv (every
evaluation) and OUT.md (the tables). Runs are cached under --cache: a killed study resumes.

    nice -n 10 python experiments/convergence.py --out docs/convergence     # ~100 CPU-minutes
    python experiments/convergence.py --quick                                 # ~1 minute
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: pipefisher and experiments

from experiments.convergence_study.report import (
    MethodResult,
    final,
    goal_lines,
    grid_table,
    plot,
    results_table,
    steps_to,
    Tuning,
    tuning_lines,
    write_csv,
)  # noqa: E402
from experiments.convergence_study.runs import FIRST_ORDER, ROOT, WORKLOADS, RunResult, Setting, Sizing, cached, run  # noqa: E402
from experiments.convergence_study.timing import StepTime, paper_scale, step_time  # noqa: E402
from experiments.common import experiment_output  # noqa: E402
from pipefisher.cli.scripts import entry_point  # noqa: E402

#: lr grids: AdamW/LAMB's optimizer.lr, a curvature method's section lr (K-FAC and Shampoo: SGD
#: with momentum 0.9 after preconditioning, so about a tenth of an Adam-like lr for Shampoo).
GRIDS = {
    "adamw": (3e-4, 1e-3, 3e-3),
    "lamb": (0.01, 0.03, 0.1),
    "kfac": (0.03, 0.1, 0.3),
    "shampoo": (1e-4, 3e-4, 1e-3),
    "soap": (1e-3, 3e-3, 1e-2),
    "muon": (0.01, 0.02, 0.05),
}
QUICK = Sizing(
    steps=30, warmup=3, micro_batches=2, micro_batch_size=2, seq_len=16, vocab_size=600, eval_every=10, eval_batches=2
)
QUICK_K = 10
#: how often a grid whose best point is at an edge grows past it
EXTEND = 2


def log(t0: float, message: str) -> None:
    print(f"[{time.perf_counter() - t0:6.0f} s] {message}", file=sys.stderr, flush=True)


def grid(workload: str, method: str, quick: bool) -> tuple[float, ...]:
    """`method`'s lr grid; a method without one: its section's lr x (1/3, 1, 3)."""
    if method in GRIDS:
        points = GRIDS[method]
    else:
        from pipefisher.config import load_config

        lr = load_config(ROOT / WORKLOADS[workload].run_file).section(method).lr
        points = (lr / 3, lr, lr * 3)
    return points[:2] if quick else points


def default_methods() -> list[str]:
    from pipefisher.methods.registry import methods

    return [*FIRST_ORDER, *methods()]


class Study:
    """The runs of one workload, in order: AdamW, then each method, each on its grid then seeds."""

    def __init__(
        self, workload: str, sizing: Sizing, seeds: int, cache: Path, quick: bool, t0: float, remeasure: bool = False
    ):
        self.workload, self.sizing, self.seeds, self.cache, self.quick, self.t0 = (
            workload,
            sizing,
            seeds,
            cache,
            quick,
            t0,
        )
        self.remeasure = remeasure
        self.train_new = True
        self.grid: dict[Setting, RunResult] = {}
        self.all: dict[Setting, RunResult] = {}
        self.tuning: dict[str, Tuning] = {}

    def train(self, setting: Setting) -> RunResult:
        if not self.train_new and cached(setting, self.sizing, self.cache) is None:
            raise RuntimeError(f"{setting.name} was not run (--cached-only)")
        result = run(setting, self.sizing, self.cache)
        self.all[setting] = result
        log(
            self.t0,
            f"{setting.name}: held-out {final(result):.3f} ({result.seconds:.0f} s, "
            f"{1000 * result.seconds / self.sizing.steps:.0f} ms/step incl. evaluation)",
        )
        return result

    def times(self, method: str, measure: bool) -> StepTime | None:
        if not measure:
            return None
        log(self.t0, f"{self.workload} {method}: its step time, from the cache or a `pipefisher run` now")
        times = step_time(self.workload, method, self.sizing, self.cache, again=self.remeasure)
        log(
            self.t0,
            f"{self.workload} {method}: {times.measured_ms:.1f} ms/step here (k {times.k}), "
            f"{times.paper_ms:.0f} ms at paper scale (k {times.paper_k})",
        )
        return times

    def tune(self, method: str, base_lr: float | None, k: int, rank) -> Setting:
        """The best of `method`'s grid by `rank` (lower is better): a best at an edge of the grid
        extends it past that edge by the grid's own ratio, up to `EXTEND` times; then the two
        half-steps either side of the best (its lr x ratio^(-1/2), x ratio^(1/2)) refine it."""
        lrs = list(grid(self.workload, method, self.quick))
        ratio = lrs[1] / lrs[0]
        for grown in range(EXTEND + 1):
            settings = [Setting(self.workload, method, lr, 0, base_lr, k) for lr in lrs]
            best = self._best(settings, rank)
            if self.quick or 0 < lrs.index(best.lr) < len(lrs) - 1 or grown == EXTEND:
                break
            edge = lrs.index(best.lr)
            lrs.insert(len(lrs) if edge else 0, best.lr * ratio ** (1 if edge else -1))
        if not self.quick:
            settings += [Setting(self.workload, method, best.lr * ratio**half, 0, base_lr, k) for half in (-0.5, 0.5)]
            best = self._best(settings, rank)
        self.tuning[method] = Tuning(method, tuple(sorted(s.lr for s in settings)), best.lr)
        return best

    def _best(self, settings: list[Setting], rank) -> Setting:
        """The best of `settings` by `rank`, each trained (or read from the cache) first."""
        for setting in settings:
            if setting not in self.grid:
                self.grid[setting] = self.train(setting)
        return min(settings, key=lambda s: rank(self.grid[s]))

    def seeded(self, tuned: Setting) -> list[RunResult]:
        return [self.grid[tuned]] + [
            self.train(Setting(tuned.workload, tuned.method, tuned.lr, seed, tuned.base_lr, tuned.k))
            for seed in range(1, self.seeds)
        ]

    def method(self, method: str, base_lr: float, target: float, measure: bool) -> MethodResult:
        curvature = method not in FIRST_ORDER
        times = self.times(method, measure) if curvature else None
        k = times.k if times else QUICK_K
        tuned = self.tune(
            method,
            base_lr if curvature else None,
            k if curvature else 0,
            lambda result: (steps_to(result, target), final(result)),
        )
        runs = self.seeded(tuned)
        if not curvature:
            times = self.times(method, measure)
        return MethodResult(method, tuned, runs, times or _reference_time(method, runs, self.sizing))


def _reference_time(method: str, runs: list[RunResult], sizing: Sizing) -> StepTime:
    """--no-measure: the reference runs' own ms/step (evaluation included) stands for the
    measured step; the paper-scale prediction is computed all the same."""
    paper, paper_k = paper_scale(method)
    return StepTime(
        1000 * min(r.seconds for r in runs) / sizing.steps, QUICK_K if method not in FIRST_ORDER else 0, paper, paper_k
    )


def study_workload(study: Study, methods: list[str], measure: bool) -> tuple[list[MethodResult], float, list[str]]:
    """(tuned results, AdamW first; target; methods that failed, with why)."""
    adamw = study.tune("adamw", None, 0, final)
    adamw_runs = study.seeded(adamw)
    target = sorted(final(r) for r in adamw_runs)[len(adamw_runs) // 2]
    times = study.times("adamw", measure)
    results = [MethodResult("adamw", adamw, adamw_runs, times or _reference_time("adamw", adamw_runs, study.sizing))]
    failed = []
    for method in methods:
        if method == "adamw":
            continue
        try:
            results.append(study.method(method, adamw.lr, target, measure))
        except Exception as exc:  # a method that cannot run here is reported, the others go on
            failed.append(f"{method}: {type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[-1]}")
            log(study.t0, f"{study.workload} {method} failed: {failed[-1]}")
    return results, target, failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="bert,gpt2", help="comma-separated, of: " + ", ".join(WORKLOADS))
    parser.add_argument(
        "--methods", default="", help="comma-separated (default: adamw, lamb and every registered curvature method)"
    )
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 600; --quick 30)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds at the tuned settings (default 3; --quick 2)")
    parser.add_argument(
        "--quick", action="store_true", help="a smoke version: tiny sizes, 2-point grids, no step-time measurement"
    )
    parser.add_argument(
        "--no-measure", action="store_true", help="no `pipefisher run` timing: the reference runs' ms/step instead"
    )
    parser.add_argument(
        "--remeasure", action="store_true", help="measure every step time anew (at the cached k), back to back"
    )
    parser.add_argument(
        "--cached-only",
        action="store_true",
        help="train nothing: a method with a run missing from the cache is reported as not run",
    )
    parser.add_argument(
        "--cache",
        default="",
        help="run cache folder (default $PIPEFISHER_CACHE/convergence or /tmp/pfcache/convergence)",
    )
    parser.add_argument(
        "--out",
        default=str(experiment_output("convergence")),
        help=f"OUT.png, OUT.csv and OUT.md (default {experiment_output('convergence')})",
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("PIPEFISHER_CACHE", "/tmp/pfcache")
    sizing = QUICK if args.quick else Sizing()
    if args.steps:
        sizing = dataclasses.replace(sizing, steps=args.steps)
    seeds = args.seeds or (2 if args.quick else 3)
    methods = args.methods.split(",") if args.methods else default_methods()
    if args.quick and not args.methods:
        methods = ["adamw", default_methods()[len(FIRST_ORDER)]]
    cache = Path(args.cache or Path(os.environ["PIPEFISHER_CACHE"]) / "convergence")
    measure = not (args.quick or args.no_measure)
    t0 = time.perf_counter()

    per_workload, lines, all_runs = {}, [], {}
    for workload in args.workloads.split(","):
        study = Study(workload, sizing, seeds, cache, args.quick, t0, args.remeasure)
        study.train_new = not args.cached_only
        results, target, failed = study_workload(study, methods, measure)
        per_workload[workload] = (results, target)
        all_runs.update(study.all)
        lines += [
            f"## {WORKLOADS[workload].label}",
            "",
            f"Target: held-out {WORKLOADS[workload].loss} loss {target:.3f}, the median over {seeds} seeds of AdamW's "
            f"final. Tuned methods, seeds 0..{seeds - 1}:",
            "",
            *results_table(results, target),
            "",
            *goal_lines(results, target),
            "",
            "Grids (seed 0):",
            "",
            *grid_table(study.grid, target),
            "",
            *tuning_lines(list(study.tuning.values())),
            "",
        ]
        lines += [f"Not in the table: {line}" for line in failed] + ([""] if failed else [])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_csv(out.with_suffix(".csv"), all_runs)
    plot(out.with_suffix(".png"), per_workload)
    command = "python experiments/convergence.py " + " ".join(argv if argv is not None else sys.argv[1:])
    header = [
        f"# Convergence on held-out text ({sizing.steps} steps, {seeds} seeds)",
        "",
        f"Command: `{command.strip()}`",
        "",
        f"Sizes: {sizing}.",
        "",
    ]
    text = (
        "\n".join(header + lines)
        + f"\nFigure: {out.with_suffix('.png')}; every evaluation: {out.with_suffix('.csv')}.\n"
    )
    out.with_suffix(".md").write_text(text)
    print(text)
    log(t0, f"wrote {out.with_suffix('.md')}, .png and .csv")
    return 0 if math.isfinite(per_workload[next(iter(per_workload))][1]) else 1


if __name__ == "__main__":
    sys.exit(entry_point(main, "convergence"))
