"""Tiny BERT pretraining on this machine: LAMB vs AdamW vs PipeFisher K-FAC vs PipeFisher Shampoo,
steps and simulated wall time to a target masked-LM loss.

Every run is `train_reference` (the single-process twin of the pipelined training: same data,
initialisation, loss scaling and K-FAC / Shampoo cycle) of `schedules/tiny-cpu.yaml` (BERT 4x128,
sequence 64, 4 micro-batches of 8, warm-up 10 then linear decay to 0 at --steps, clip 1.0), one
thread.

1. Profiles: `pipefisher profile schedules/tiny-cpu.yaml [--optimizer shampoo]` measures this
   machine once per curvature method (or --profile / --shampoo-profile FILE). The packer
   (`pipefisher.planning.packing.pack.pack`) picks each method's refresh interval k and predicts its PipeFisher
   step time on a 2-stage 1F1B pipeline (Shampoo's step end includes its preconditioning);
   `pipefisher.planning.simulate.simulate` predicts the first-order step time (LAMB and AdamW alike: the
   K-FAC profile's step end is the run file's LAMB step). K-FAC and Shampoo runs use their k as
   refresh_steps.
2. Tuning on seed 0: a grid of four points or fewer per optimizer (learning rate; K-FAC: also
   damping, Shampoo: also epsilon; SGD momentum 0.9 after preconditioning), all for the full
   step budget.
3. Target: the smoothed MLM loss that the best seed-0 run (lowest final smoothed loss) reaches at
   2/3 of the budget. "Smoothed" = trailing mean over --window steps; steps to target = first step
   whose trailing mean is <= target. Per optimizer the setting with the fewest steps wins (none
   reaching it: the lowest final loss).
4. Seeds 1.. at the tuned settings (seed = model init seed = data seed: masking and sentence pairs).

Report: median steps to target over seeds ("not reached" counts as infinite), per-seed steps,
simulated wall time = median steps x predicted step time. Writes OUT.png (MLM loss vs step and vs
simulated time, median over seeds) and OUT.csv (optimizer, seed, step, mlm, nsp, loss).

    PIPEFISHER_CACHE=/tmp/pfcache python experiments/convergence.py   # ~20 min on 2 cores
    PIPEFISHER_CACHE=/tmp/pfcache python experiments/convergence.py --quick    # ~3 min
"""

from __future__ import annotations

import argparse
import csv
import math
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pipefisher.core.files import experiment_output
from pipefisher.runtime.training.stopping import entry_point, leave_interrupts_to_the_parent, stop_signals_blocked

ROOT = Path(__file__).resolve().parent.parent
BASE = ROOT / "schedules" / "tiny-cpu.yaml"
OPTIMIZERS = ("lamb", "adamw", "kfac", "shampoo")
LABELS = {"lamb": "LAMB", "adamw": "AdamW", "kfac": "PipeFisher K-FAC", "shampoo": "PipeFisher Shampoo"}
#: the curvature methods: packed into the bubbles, each with its own profile
CURVATURE = ("kfac", "shampoo")
# (optimizer) -> grid of (lr, damping); damping is K-FAC's damping and Shampoo's epsilon. Ranges
# from a wider 150-step exploration (K-FAC damping 1e-3 and lr 0.03 were clearly worse there).
# Shampoo grafts Adam's step size (SGD momentum 0.9 after it, as K-FAC), so its lr is Adam-like
# divided by about 10; its epsilon made no difference between 1e-12 and 1e-6 in a first run, so
# its four points all go to the learning rate.
GRIDS = {
    "lamb": [(lr, None) for lr in (0.01, 0.03, 0.1)],
    "adamw": [(lr, None) for lr in (3e-4, 1e-3, 3e-3)],
    "kfac": [(lr, d) for d in (1e-2, 1e-1) for lr in (0.1, 0.3)],
    "shampoo": [(lr, 1e-12) for lr in (3e-5, 1e-4, 3e-4, 1e-3)],
}
QUICK_GRIDS = {
    "lamb": [(lr, None) for lr in (0.01, 0.03)],
    "adamw": [(lr, None) for lr in (1e-3, 3e-3)],
    "kfac": [(lr, 1e-1) for lr in (0.1, 0.3)],
    "shampoo": [(lr, 1e-12) for lr in (1e-4, 3e-4)],
}
KFAC_MOMENTUM = 0.9


@dataclass(frozen=True)
class Setting:
    optimizer: str
    lr: float
    damping: float | None
    seed: int

    @property
    def name(self) -> str:
        damping = f" damping {self.damping:g}" if self.damping is not None else ""
        return f"{self.optimizer} lr {self.lr:g}{damping} seed {self.seed}"


def make_config(setting: Setting, steps: int, refresh_steps: dict[str, int]):
    from pipefisher.config import load_config

    optimizer = {"name": setting.optimizer, "lr": setting.lr}
    sections: dict[str, dict] = {}
    if setting.optimizer in CURVATURE:  # the run file's section lr/momentum would replace optimizer's
        damping = {"kfac": "damping", "shampoo": "epsilon"}[setting.optimizer]
        sections[setting.optimizer] = {"refresh_steps": refresh_steps[setting.optimizer], damping: setting.damping,
                                       "lr": setting.lr, "momentum": KFAC_MOMENTUM}
    return load_config(BASE).with_overrides(
        optimizer=optimizer, run={"steps": steps, "seed": setting.seed}, data={"seed": setting.seed}, **sections,
    )


def train(setting: Setting, steps: int, refresh_steps: dict[str, int]) -> tuple[Setting, list[tuple[int, float, float, float]], float]:
    """One reference run in this (worker) process: per step (step, mlm, nsp, loss), and seconds."""
    import warnings

    import torch

    torch.set_num_threads(1)
    from pipefisher.runtime.training.reference import train_reference

    rows: list[tuple[int, float, float, float]] = []

    def on_step(result) -> None:
        rows.append((result.step, result.extra["mlm"], result.extra["nsp"], result.loss))

    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train_reference(make_config(setting, steps, refresh_steps), on_step=on_step)
    return setting, rows, time.perf_counter() - start


def _train(job: tuple[Setting, int, dict[str, int]]):
    return train(*job)


def _init_worker() -> None:
    """One thread; a Ctrl-C is the parent's to act on (it ends the pool)."""
    import torch

    leave_interrupts_to_the_parent()
    torch.set_num_threads(1)


def run_all(settings: list[Setting], steps: int, k: dict[str, int], jobs: int, t0: float) -> dict[Setting, list]:
    # the curvature methods' runs are the longest: start them first.
    order = sorted(settings, key=lambda s: s.optimizer not in CURVATURE)
    results = {}
    # multiprocessing's Pool ends its workers when the block is left, by a signal too
    with stop_signals_blocked():
        pool = multiprocessing.get_context("spawn").Pool(jobs, initializer=_init_worker)
    with pool:
        for setting, rows, seconds in pool.imap_unordered(_train, [(s, steps, k) for s in order]):
            results[setting] = rows
            mlm = smooth([r[1] for r in rows], window_for(steps))
            print(f"[{time.perf_counter() - t0:6.0f} s] {setting.name}: final smoothed mlm {mlm[-1]:.3f} "
                  f"({seconds:.0f} s, {1000 * seconds / steps:.0f} ms/step)", file=sys.stderr, flush=True)
    return results


def window_for(steps: int) -> int:
    return max(5, round(steps / 15))


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to `window` values (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def steps_to(curve: list[float], target: float, window: int) -> int | None:
    """First step (1-based) whose full-window trailing mean is <= target."""
    for i in range(window - 1, len(curve)):
        if curve[i] <= target:
            return i + 1
    return None


def step_times(profile_path: Path, method: str, k_override: int | None) -> tuple[float, float, int, str]:
    """(first-order ms, PipeFisher packed ms (mean over the cycle), k, summary) of 2-stage 1F1B
    with `method`'s profile (K-FAC's also gives the first-order step: LAMB's step end)."""
    from pipefisher.config import load_config
    from pipefisher.planning.packing.pack import pack
    from pipefisher.core.profile import load_profile
    from pipefisher.runtime.training.pipefisher_run import pack_options
    from pipefisher.runtime.training.assembly import build_schedule
    from pipefisher.planning.simulate import simulate

    config = load_config(BASE).with_overrides(optimizer={"name": method})
    schedule = build_schedule(config)
    profile = load_profile(profile_path)
    packed = pack(schedule, profile, pack_options(config, refresh_steps=k_override))
    first_order = simulate(schedule, profile).step_time
    summary = (f"{method} profile {profile_path}: 1F1B D=2 N=4, first-order step {first_order:.1f} ms, PipeFisher packed "
               f"k={packed.refresh_steps} (lower bound {packed.lower_bound}) step {packed.step_time:.1f} ms "
               f"(preconditioning only {packed.precondition_step_time:.1f} ms, packing overhead {100 * packed.overhead:.1f} %)")
    return first_order, packed.step_time, packed.refresh_steps, summary


def measure_profile(path: Path, method: str) -> None:
    """`pipefisher profile` of the base run with `method`'s tasks (Shampoo's step end includes its
    preconditioning)."""
    print(f"measuring a profile: pipefisher profile {BASE.relative_to(ROOT)} --optimizer {method} -o {path}", file=sys.stderr, flush=True)
    subprocess.run(
        [sys.executable, "-m", "pipefisher", "profile", str(BASE), "-o", str(path), "--master-port", "0", "--optimizer", method],
        check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
    )


def median_steps(values: list[int | None]) -> float:
    return statistics.median([math.inf if v is None else v for v in values])


def fmt_steps(value: float) -> str:
    if math.isinf(value):
        return "not reached"
    return f"{value:g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="step budget per run (default 300; --quick 50)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds at the tuned settings (default 3; --quick 2)")
    parser.add_argument("--quick", action="store_true", help="a ~4-minute version: 50 steps, 2 seeds, 2-point grids")
    parser.add_argument("--out", default=str(experiment_output("convergence")),
                        help=f"OUT.png and OUT.csv (default {experiment_output('convergence')}; docs/performance.md's: docs/convergence)")
    parser.add_argument("--profile", default="", help="a K-FAC pipefisher.profile/v1 file of schedules/tiny-cpu.yaml (default: measure one)")
    parser.add_argument("--shampoo-profile", default="", help="a Shampoo profile of it (`pipefisher profile --optimizer shampoo`; default: measure one)")
    parser.add_argument("--refresh-steps", type=int, default=None, help="pin k of K-FAC and Shampoo (default: the packer's choice)")
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel (one thread each; default 2)")
    args = parser.parse_args(argv)
    steps = args.steps or (50 if args.quick else 300)
    seeds = args.seeds or (2 if args.quick else 3)
    grids = QUICK_GRIDS if args.quick else GRIDS
    window = window_for(steps)
    os.environ.setdefault("PIPEFISHER_CACHE", "/tmp/pfcache")
    t0 = time.perf_counter()

    step_ms, k, summaries = {}, {}, []
    for method, given in (("kfac", args.profile), ("shampoo", args.shampoo_profile)):
        profile = Path(given) if given else Path(f"/tmp/pipefisher-convergence-profile-{method}.yaml")
        if not given:
            measure_profile(profile, method)
        fo_ms, step_ms[method], k[method], summary = step_times(profile, method, args.refresh_steps)
        if method == "kfac":
            step_ms["lamb"] = step_ms["adamw"] = fo_ms
        summaries.append(summary)
        print(summary, file=sys.stderr, flush=True)
    summary = "\n".join(summaries)

    # 1. tuning on seed 0
    tuning = [Setting(opt, lr, d, 0) for opt in OPTIMIZERS for lr, d in grids[opt]]
    results = run_all(tuning, steps, k, args.jobs, t0)
    curves = {s: smooth([r[1] for r in rows], window) for s, rows in results.items()}
    best = min(tuning, key=lambda s: curves[s][-1])
    at = round(2 * steps / 3)
    target = curves[best][at - 1]
    tuned: dict[str, Setting] = {}
    grid_lines = []
    for opt in OPTIMIZERS:
        candidates = [s for s in tuning if s.optimizer == opt]
        key = lambda s: (steps_to(curves[s], target, window) or math.inf, curves[s][-1])
        tuned[opt] = min(candidates, key=key)
        for s in candidates:
            grid_lines.append(f"| {LABELS[opt]} | {s.lr:g} | {'' if s.damping is None else f'{s.damping:g}'} | "
                              f"{fmt_steps(key(s)[0])} | {curves[s][-1]:.3f} |")

    # 2. more seeds at the tuned settings
    more = [Setting(t.optimizer, t.lr, t.damping, seed) for t in tuned.values() for seed in range(1, seeds)]
    results.update(run_all(more, steps, k, args.jobs, t0) if more else {})

    runs = {opt: [Setting(t.optimizer, t.lr, t.damping, seed) for seed in range(seeds)] for opt, t in tuned.items()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["optimizer", "seed", "step", "mlm", "nsp", "loss"])
        for opt in OPTIMIZERS:
            for s in runs[opt]:
                for step, mlm, nsp, loss in results[s]:
                    writer.writerow([opt, s.seed, step, f"{mlm:.5f}", f"{nsp:.5f}", f"{loss:.5f}"])

    table = []
    medians = {}
    for opt in OPTIMIZERS:
        t = tuned[opt]
        per_seed = [steps_to(smooth([r[1] for r in results[s]], window), target, window) for s in runs[opt]]
        med = median_steps(per_seed)
        medians[opt] = [statistics.median(v) for v in zip(*[smooth([r[1] for r in results[s]], window) for s in runs[opt]])]
        wall = "not reached" if math.isinf(med) else f"{med * step_ms[opt] / 1000:.1f}"
        damping = {"kfac": "damping", "shampoo": "epsilon"}.get(opt)
        setting = f"lr {t.lr:g}" + (f", {damping} {t.damping:g}, k {k[opt]}, momentum {KFAC_MOMENTUM}" if damping else "")
        table.append(f"| {LABELS[opt]} | {setting} | {fmt_steps(med)} | "
                     f"{', '.join('n/r' if v is None else str(v) for v in per_seed)} | {wall} | {step_ms[opt]:.1f} | "
                     f"{medians[opt][-1]:.3f} |")

    plot(out.with_suffix(".png"), medians, step_ms, target, steps, seeds, window, k)

    command = "PIPEFISHER_CACHE=/tmp/pfcache python experiments/convergence.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"# Convergence: tiny BERT (4x128, seq 64, 32 sequences/step), {steps} steps, {seeds} seed(s)\n")
    print(f"command: `{command.strip()}`\n")
    print(summary + "\n")
    print(f"target: MLM loss {target:.3f} = the {window}-step trailing mean of the best seed-0 run "
          f"({best.name}) at step {at}\n")
    print("Tuning (seed 0; steps to target, final smoothed MLM):\n")
    print("| optimizer | lr | damping (K-FAC) / epsilon (Shampoo) | steps to target | final MLM |\n|---|---|---|---|---|")
    print("\n".join(grid_lines) + "\n")
    print(f"Tuned, seeds 0..{seeds - 1}:\n")
    print("| optimizer | tuned setting | median steps to target | per-seed steps | simulated wall time to target [s] | predicted step time [ms] | final MLM (median) |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(table))
    print(f"\nwrote {out.with_suffix('.png')} and {out.with_suffix('.csv')}; {time.perf_counter() - t0:.0f} s")
    return 0


def plot(path: Path, medians: dict[str, list[float]], step_ms: dict[str, float], target: float,
         steps: int, seeds: int, window: int, k: dict[str, int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {"lamb": "tab:blue", "adamw": "tab:green", "kfac": "tab:red", "shampoo": "tab:purple"}
    for opt, curve in medians.items():
        xs = list(range(1, len(curve) + 1))
        label = LABELS[opt] + (f" (k={k[opt]})" if opt in CURVATURE else "")
        axes[0].plot(xs, curve, color=colors[opt], label=label)
        axes[1].plot([x * step_ms[opt] / 1000 for x in xs], curve, color=colors[opt],
                     label=f"{label}, {step_ms[opt]:.0f} ms/step")
    for ax, xlabel in zip(axes, ("step", "simulated wall time, 2-stage 1F1B on this CPU [s]")):
        ax.axhline(target, color="gray", linestyle="--", linewidth=1, label=f"target {target:.2f}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"MLM loss ({window}-step trailing mean, median of {seeds} seeds)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_title("MLM loss vs step")
    axes[1].set_title("MLM loss vs simulated wall time")
    fig.suptitle(f"Tiny BERT pretraining (bert-4x128, seq 64, 32 seq/step), {steps} steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(entry_point(main, "convergence"))
