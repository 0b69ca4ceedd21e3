"""K-FAC-reduce (`kfac.approximation: reduce`) against K-FAC-expand on the convergence study's
held-out text: the study's tuned K-FAC setting of each workload (learning rate, k, AdamW for the
rest) trained again with one factor row per sequence, 3 seeds, judged as the study judges
(steps to AdamW's median final held-out loss, `experiments/convergence.md`). Expand's and AdamW's
runs are the study's kept records (`--cache`, docs/convergence_runs); reduce's are trained now
(about 25 s each here, one thread).

    python experiments/kfac_reduce.py            # 6 runs, ~3 min
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: pipefisher and experiments

from experiments.convergence_study.report import final, steps_to  # noqa: E402
from pipefisher.cli.scripts import entry_point  # noqa: E402
from experiments.convergence_study.runs import (  # noqa: E402
    WORKLOADS,
    RunResult,
    Setting,
    Sizing,
    cached,
    make_config,
    train,
)

SEEDS = (0, 1, 2)


def tuned(workload: str, method: str, cache: Path) -> Setting:
    """The study's tuned setting of `method` on `workload`: the one it trained seeds 1 and 2 at."""
    for path in sorted(cache.glob(f"{workload}-{method}-*.json")):
        setting = Setting(**json.loads(path.read_text())["setting"])
        if setting.seed == 1:
            return setting
    raise SystemExit(f"kfac_reduce: no tuned {method} run of {workload} in {cache}; run experiments/convergence.py")


def kept(setting: Setting, seed: int, sizing: Sizing, cache: Path) -> RunResult:
    found = cached(Setting(**{**setting.__dict__, "seed": seed}), sizing, cache)
    if found is None:
        raise SystemExit(f"kfac_reduce: {setting.name} seed {seed} not in {cache}")
    return found


def row(label: str, runs: list[RunResult], target: float, baseline: float) -> str:
    steps = [steps_to(run, target) for run in runs]
    median = statistics.median(steps)
    seeds = ", ".join("–" if s == float("inf") else f"{s:.0f}" for s in steps)
    finals = statistics.median(final(run) for run in runs)
    return f"| {label} | {finals:.3f} | {median:.0f} ({seeds}) | {median / baseline:.2f} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--cache", type=Path, default=Path("docs/convergence_runs"), help="the study's kept runs")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated (default bert,gpt2)")
    args = parser.parse_args(argv)
    sizing = Sizing()
    for workload in args.workloads.split(","):
        adamw = [kept(tuned(workload, "adamw", args.cache), seed, sizing, args.cache) for seed in SEEDS]
        kfac = tuned(workload, "kfac", args.cache)
        expand = [kept(kfac, seed, sizing, args.cache) for seed in SEEDS]
        reduce = []
        for seed in SEEDS:
            config = make_config(Setting(**{**kfac.__dict__, "seed": seed}), sizing)
            reduce.append(
                train(config.with_overrides(kfac={"approximation": "reduce"}), sizing, WORKLOADS[workload].part)
            )
            print(
                f"{workload} reduce seed {seed}: held-out {final(reduce[-1]):.3f}, {reduce[-1].seconds:.0f} s",
                flush=True,
            )
        target = statistics.median(final(run) for run in adamw)
        baseline = statistics.median(steps_to(run, target) for run in adamw)
        print(f"\n{WORKLOADS[workload].label}: {kfac.name.removesuffix(' seed 1')}; target {target:.3f}")
        print("| K-FAC | held-out at 600 (median) | steps to target (seeds) | × AdamW steps |\n|---|---|---|---|")
        print(row("expand (the study's runs)", expand, target, baseline))
        print(row("reduce", reduce, target, baseline))
    return 0


if __name__ == "__main__":
    sys.exit(entry_point(main, "kfac_reduce"))
