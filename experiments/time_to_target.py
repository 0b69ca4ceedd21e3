"""Time to target of real pipelined runs: held-out loss against steps and against measured
seconds, AdamW and every registered curvature method packed into the bubbles, 2 stages, 1F1B and
ZB-H1, on the BERT MLM demo and the GPT-2 causal-LM demo (issue 47, item 1).

Every run is a real `pipefisher run` (`time_to_target_study.runs`: 2 gloo processes of one
thread) of `schedules/tiny-cpu.yaml` (BERT, bert-4x128) or `schedules/gpt2-tiny-cpu.yaml`
(GPT-2 tiny, 4 blocks of width 128) reading token shards of --corpus (WordPiece or byte-level
BPE, 10 % of the documents held out, prepared once under --cache), warm-up then linear decay, clipping 1.0, dropout 0,
evaluating the held-out loss in the pipeline every --eval-every steps (and after the last) on
8 held-out micro-batches (`run.eval_every`; BERT: its MLM + NSP loss, the only one
the pipeline's record carries). Default size: 4 micro-batches of 32 sequences of 64 tokens =
8,192 tokens per step, 64 tokens per unit of hidden width (the speed benchmark's
configuration, `experiments/bench_exposed.py`), 600 steps, vocabulary 4000, evaluation every 50
steps.

Measured time: the sum of the run's step times (`step_time_ms` of its metrics records) up to an
evaluation; start-up, profiling, packing and the evaluations themselves are not in it.

Protocol, per workload (seed 0 and the first schedule tune; `--seeds` S):
1. AdamW on its lr grid, the lowest final held-out loss wins.
2. Every other method on its grid (its section's lr; AdamW at the tuned AdamW lr for what it does
   not precondition), the grids' points interleaved round-robin over the methods; the fewest
   steps to AdamW's seed-0 final loss wins (then the lowest final loss). A best point at an edge
   of a grid grows the grid past it (a factor of the grid's ratio), up to twice, as
   experiments/convergence.py does; --refine then runs the half-steps either side of every
   method's best (AdamW's first: x ratio^-1/2, x ratio^1/2) and keeps the better.
3. Seeds 0..S-1 on every schedule at the tuned settings, round-robin over the methods for each
   (seed, schedule), so that the machine's load drifts hit every method alike.
Target: the median over AdamW's seeds (first schedule) of its final held-out loss. Per method and
schedule: steps and measured seconds to target (first crossing, linear between evaluations;
medians over seeds), median step time against AdamW's, the run's own exposed optimizer time
share, and the check that seconds to target agree with steps to target x median step within 10 %.
Writes OUT.md (tables), OUT.csv (every evaluation) and OUT.png (curves vs step and vs seconds).
Every run leaves a JSON record under --runs (default: under --cache): a killed study resumes, and
the published study (docs/time_to_target_runs) keeps the runs its tables were made of, so that it
can be extended by later sessions on other machines.

Corpus: --corpus (any `pipefisher data prepare` inputs); the default, the embedded corpus, holds
about 0.3 M training tokens, so 600 steps of 8,192 tokens pass over it about 17 times: a larger
text gives a study whose AdamW flattens without repeating its data.

Cost of the full study (defaults): per workload about 15 tuning runs (5 methods x 3 lrs, more
where a grid grows) and 25 seeded runs (5 methods x (2 more seeds on 1F1B + 3 on ZB-H1)), so
about 80 runs of 600 steps. Measured here at the default size, load 4: 1.1-2.2 s per step
(AdamW and K-FAC, 2 processes of one thread), 30-60 s of start-up per run: about 12-25 hours on
this 2-core machine, 25-50 CPU-hours. At 300 steps (2026-11-29): BERT 0.39-0.48 s per step, about
2.3 minutes per run (42 runs, both schedules, 97 minutes); GPT-2 about 1.4 s per step, 7 minutes.

    nice -n 10 python experiments/time_to_target.py --out docs/time_to_target   # the full study
    python experiments/time_to_target.py --quick      # GPT-2, tiny, adamw + kfac, 1 seed: ~2 minutes here
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: pipefisher and experiments

from experiments.common import UsageError, experiment_output, listed  # noqa: E402
from experiments.convergence import EXTEND, grid  # noqa: E402
from experiments.convergence_study.runs import FIRST_ORDER, WORKLOADS, Sizing  # noqa: E402
from experiments.time_to_target_study.report import (  # noqa: E402
    Arm,
    final,
    grid_table,
    plot,
    results_table,
    steps_to,
    write_csv,
)
from experiments.time_to_target_study.runs import (  # noqa: E402
    CORPUS,
    PipelinedRun,
    Setting,
    Store,
    cached,
    measured_on,
    run,
)
from pipefisher.cli.scripts import entry_point  # noqa: E402

SIZING = Sizing(
    steps=600,
    warmup=30,
    micro_batches=4,
    micro_batch_size=32,
    seq_len=64,
    vocab_size=4000,
    eval_every=50,
    eval_batches=8,
)
QUICK = Sizing(
    steps=10, warmup=2, micro_batches=2, micro_batch_size=2, seq_len=16, vocab_size=600, eval_every=5, eval_batches=2
)
#: --quick pins the curvature methods' refresh interval (no profile-chosen k longer than the run)
QUICK_K = 4
SCHEDULES = ("1f1b", "zb-h1")
#: grids centred where an earlier study of the same workload found the optimum (GPT-2, 300 steps,
#: 2026-11-28: Muon's best, 0.005, sat at the edge its default grid grew to; SOAP's at 0.001)
CENTRED = {("gpt2", "muon"): (0.0025, 0.005, 0.01), ("gpt2", "soap"): (1e-3 / 3, 1e-3, 3e-3)}
WIDTH = 128  # hidden width of both demo models


def positive(text: str) -> int:
    """argparse type: a positive integer."""
    value = int(text) if text.strip().lstrip("-").isdigit() else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def log(t0: float, message: str) -> None:
    print(f"[{time.perf_counter() - t0:6.0f} s] {message}", file=sys.stderr, flush=True)


class Study:
    """The runs of one workload, in the protocol's order (`all`: every run it trained or read)."""

    def __init__(self, workload: str, sizing: Sizing, schedules: list[str], seeds: int, store: Store, quick: bool):
        self.workload, self.sizing, self.schedules, self.seeds = workload, sizing, schedules, seeds
        self.store, self.quick, self.t0 = store, quick, time.perf_counter()
        self.k = QUICK_K if quick else 0
        self.train_new = True
        self.pin_k = False
        self.refine = False
        self.corpus = CORPUS
        self.grid: dict[Setting, PipelinedRun] = {}
        self.all: dict[Setting, PipelinedRun] = {}
        self.failed: dict[str, str] = {}

    def train(self, setting: Setting) -> PipelinedRun:
        if not self.train_new and cached(setting, self.sizing, self.store.runs, self.corpus) is None:
            raise RuntimeError(f"{setting.name} was not run (--cached-only)")
        result = run(setting, self.sizing, self.store, self.corpus)
        self.all[setting] = result
        source = "record" if result.cached else f"{result.wall_s:.0f} s wall"
        log(
            self.t0,
            f"{setting.name}: held-out {final(result):.3f} after {result.clock[-1][0] if result.clock else 0:.1f} s "
            f"of steps, {result.median_step_ms:.0f} ms/step ({source})",
        )
        return result

    def attempt(self, setting: Setting) -> PipelinedRun | None:
        """The run of `setting`; None when its method failed now or before (the failure is kept)."""
        if setting.method in self.failed:
            return None
        try:
            return self.train(setting)
        except Exception as exc:  # a method that cannot run here is reported, the others go on
            self.failed[setting.method] = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[-1]}"
            log(self.t0, f"{setting.name} failed: {self.failed[setting.method]}")
            return None

    def tune(
        self, methods: list[str], base_lr: float | None, rank: Callable[[PipelinedRun], object]
    ) -> dict[str, Setting]:
        """Each method's best lr on seed 0 and the first schedule by `rank` (lower is better), the
        grids' points run round-robin over the methods; a best at an edge extends that grid past
        it by the grid's own ratio, up to `EXTEND` times; `refine`: then the half-steps either side
        of each best (its lr x ratio^(-1/2), x ratio^(1/2)) refine it, as experiments/convergence.py does."""
        lrs = {m: list(CENTRED.get((self.workload, m)) or grid(self.workload, m, False)) for m in methods}
        ratio = {m: points[1] / points[0] for m, points in lrs.items()}
        if self.quick:  # the middle point only
            lrs = {m: points[len(points) // 2 : len(points) // 2 + 1] for m, points in lrs.items()}
        pending, best = list(methods), {}
        for grown in range(EXTEND + 1):
            self.round_robin({m: lrs[m] for m in pending}, base_lr)
            for m in list(pending):
                found = None if m in self.failed else self.best_of(m, lrs[m], rank)
                if found is None:
                    pending.remove(m)
                    continue
                best[m] = found
                edge = lrs[m].index(found.lr)
                if self.quick or 0 < edge < len(lrs[m]) - 1 or grown == EXTEND:
                    pending.remove(m)
                else:
                    lrs[m].insert(len(lrs[m]) if edge else 0, found.lr * ratio[m] ** (1 if edge else -1))
        if self.refine and not self.quick:
            halves = {m: [best[m].lr * ratio[m] ** h for h in (-0.5, 0.5)] for m in best}
            self.round_robin(halves, base_lr)
            best = {m: self.best_of(m, lrs[m] + halves[m], rank) or best[m] for m in best}
        return best

    def round_robin(self, lrs: dict[str, list[float]], base_lr: float | None) -> None:
        """Train each method's `lrs` (seed 0, the first schedule) into the grid, the i-th point of
        every method before any (i+1)-th, so that the machine's drift hits the methods alike."""
        for i in range(max(map(len, lrs.values()), default=0)):
            for m, points in lrs.items():
                if i < len(points):
                    self.grid_point(self.setting(m, points[i], 0, self.schedules[0], base_lr))

    def best_of(self, method: str, lrs: list[float], rank: Callable[[PipelinedRun], object]) -> Setting | None:
        """The lowest by `rank` of `method`'s grid points at `lrs`; None when none of them ran."""
        tried = [s for s in self.grid if s.method == method and s.lr in lrs]
        return min(tried, key=lambda s: rank(self.grid[s]), default=None)  # type: ignore[arg-type, return-value]

    def grid_point(self, setting: Setting) -> None:
        """Train `setting` into the grid unless it is there (a failed method is left out)."""
        if setting not in self.grid and (found := self.attempt(setting)) is not None:
            self.grid[setting] = found

    def setting(self, method: str, lr: float, seed: int, schedule: str, base_lr: float | None) -> Setting:
        curvature = method not in FIRST_ORDER
        return Setting(self.workload, schedule, method, lr, seed, base_lr if curvature else None, self.k * curvature)

    def seeded(self, tuned: dict[str, Setting]) -> list[Arm]:
        """Seeds 0..S-1 on every schedule at the tuned settings, round-robin over the methods;
        `pin_k`: a curvature method's later schedules refresh at the k its packer chose on the first."""
        runs: dict[tuple[str, str], list[PipelinedRun]] = {}
        first_k: dict[tuple[str, int], int] = {}
        for seed in range(self.seeds):
            for schedule in self.schedules:
                for method, best in tuned.items():
                    setting = dataclasses.replace(best, seed=seed, schedule=schedule)
                    if self.pin_k and (method, seed) in first_k and schedule != self.schedules[0]:
                        setting = dataclasses.replace(setting, k=first_k[(method, seed)])
                    found = self.grid.get(setting) or self.attempt(setting)
                    if found is not None:
                        runs.setdefault((method, schedule), []).append(found)
                        if schedule == self.schedules[0] and method not in FIRST_ORDER:
                            first_k[(method, seed)] = found.k
        return [
            Arm(dataclasses.replace(tuned[m], schedule=schedule), runs[(m, schedule)])
            for schedule in self.schedules
            for m in tuned
            if m not in self.failed and (m, schedule) in runs
        ]


def study_workload(study: Study, methods: list[str]) -> tuple[list[Arm], float]:
    """(the tuned methods' arms, AdamW first on each schedule; the target)."""
    tuned = study.tune(["adamw"], None, final)
    if "adamw" not in tuned:
        raise RuntimeError(f"{study.workload}: AdamW did not run: {study.failed.get('adamw')}")
    provisional = final(study.grid[tuned["adamw"]])
    others = [m for m in methods if m != "adamw"]
    tuned |= study.tune(others, tuned["adamw"].lr, lambda r: (steps_to(r, provisional), final(r)))
    arms = study.seeded(tuned)
    adamw = [final(r) for arm in arms[:1] for r in arm.runs]
    return arms, sorted(adamw)[len(adamw) // 2]


def chosen(args: argparse.Namespace, everything: list[str]) -> tuple[list[str], list[str], list[str]]:
    """(methods, AdamW first; schedules; workloads) of the command line; UsageError naming the flag."""
    methods = listed(args.methods, everything, "--methods") if args.methods else everything
    if args.quick and not args.methods:
        methods = ["adamw", "kfac"]
    methods = ["adamw", *(m for m in methods if m != "adamw")]
    schedules = listed(args.schedules, SCHEDULES + ("gpipe", "interleaved", "chimera", "zbv"), "--schedules")
    workloads = listed(args.workloads or ("gpt2" if args.quick else "bert,gpt2"), WORKLOADS, "--workloads")
    return methods, schedules, workloads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="", help="comma-separated, of: bert, gpt2 (default both; --quick gpt2)")
    parser.add_argument("--methods", default="", help="comma-separated (default: adamw and every registered method)")
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated; the first tunes")
    parser.add_argument(
        "--seeds", type=positive, default=None, help="seeds at the tuned settings (default 3; --quick 1)"
    )
    parser.add_argument("--steps", type=positive, default=None, help=f"steps per run (default {SIZING.steps})")
    parser.add_argument(
        "--micro-batches", type=positive, default=None, help=f"per step (default {SIZING.micro_batches})"
    )
    parser.add_argument(
        "--micro-batch-size", type=positive, default=None, help=f"sequences (default {SIZING.micro_batch_size})"
    )
    parser.add_argument(
        "--seq-len", type=positive, default=None, help=f"tokens per sequence (default {SIZING.seq_len})"
    )
    parser.add_argument("--eval-every", type=positive, default=None, help=f"steps (default {SIZING.eval_every})")
    parser.add_argument(
        "--corpus", default="embedded", help="comma-separated `pipefisher data prepare` inputs (default embedded)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke version: GPT-2, tiny sizes, adamw + kfac, 1 seed, each grid its middle point",
    )
    parser.add_argument(
        "--cached-only", action="store_true", help="train nothing; a run without a record fails its method"
    )
    parser.add_argument(
        "--pin-k",
        action="store_true",
        help="later schedules refresh at the k each curvature method's packer chose on the first (same seed)",
    )
    parser.add_argument(
        "--refine",
        action="store_true",
        help="after the grids settle, the half-steps either side of each method's best refine it (AdamW's too)",
    )
    parser.add_argument("--cache", default="", help="token shards (default $PIPEFISHER_CACHE/time_to_target)")
    parser.add_argument("--runs", default="", help="one JSON record per run (default CACHE/runs)")
    default_out = experiment_output("time_to_target")
    parser.add_argument("--out", default=str(default_out), help=f"OUT.md, OUT.csv, OUT.png (default {default_out})")
    args = parser.parse_args(argv)
    from pipefisher.methods.registry import methods as registered

    try:
        methods, schedules, workloads = chosen(args, ["adamw", *registered()])
    except UsageError as exc:
        print(f"time_to_target: error: {exc}", file=sys.stderr)
        return 2
    sizing = QUICK if args.quick else SIZING
    flags = {"steps": args.steps, "micro_batches": args.micro_batches, "micro_batch_size": args.micro_batch_size}
    flags |= {"seq_len": args.seq_len, "eval_every": args.eval_every}
    sizing = dataclasses.replace(sizing, **{k: v for k, v in flags.items() if v})
    seeds = args.seeds or (1 if args.quick else 3)
    os.environ.setdefault("PIPEFISHER_CACHE", "/tmp/pfcache")
    cache = Path(args.cache or Path(os.environ["PIPEFISHER_CACHE"]) / "time_to_target")
    store = Store(cache, Path(args.runs) if args.runs else cache / "runs")
    load0, t0 = os.getloadavg()[0], time.perf_counter()

    per_workload, lines, all_runs, corpus = {}, [], {}, tuple(args.corpus.split(","))
    for workload in workloads:
        study = Study(workload, sizing, schedules, seeds, store, args.quick)
        study.train_new = not args.cached_only
        study.pin_k = args.pin_k
        study.refine = args.refine
        study.corpus = corpus
        arms, target = study_workload(study, methods)
        per_workload[workload] = (arms, target)
        all_runs.update(study.all)
        lines += [f"## {WORKLOADS[workload].label}", "", f"Target: held-out loss {target:.3f}, the median over "]
        lines[-1] += f"{seeds} seeds of AdamW's final on {schedules[0]}. Tuned methods, seeds 0..{seeds - 1}:"
        lines += ["", *results_table(arms, target), "", "Grids (seed 0, " + schedules[0] + "):", ""]
        lines += [*grid_table(study.grid, target), ""]
        lines += [f"Not in the table: {m}: {why}" for m, why in study.failed.items()] + [""] * bool(study.failed)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_csv(out.with_suffix(".csv"), all_runs)
    plot(out.with_suffix(".png"), per_workload)
    from_records = sum(found.cached for found in all_runs.values())
    machines = Counter(measured_on(setting, sizing, store.runs, corpus) for setting in all_runs)
    tokens = sizing.micro_batches * sizing.micro_batch_size * sizing.seq_len
    command = "python experiments/time_to_target.py " + " ".join(argv if argv is not None else sys.argv[1:])
    header = [
        f"# Time to target of pipelined runs ({sizing.steps} steps, {seeds} seeds, 2 stages)",
        "",
        f"Command: `{command.strip()}`",
        "",
        f"Sizes: {sizing}: {tokens} tokens per step, {tokens / WIDTH:g} per unit of width ({WIDTH}); "
        f"corpus {args.corpus}.",
        "",
        f"Runs: {len(all_runs) - from_records} trained now, {from_records} from their records ({store.runs}); "
        f"{time.perf_counter() - t0:.0f} s, load (1 min) {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end.",
        "",
        "Measured on: " + "; ".join(f"{where} ({n} runs)" for where, n in machines.most_common()) + ".",
        "",
        *(["Grids: refined by the half-steps either side of each best (--refine).", ""] if args.refine else []),
        *(
            [f"Refresh intervals: pinned on {', '.join(schedules[1:])} to each seed's on {schedules[0]} (--pin-k).", ""]
            if args.pin_k and len(schedules) > 1
            else []
        ),
        "Seconds: the run's training clock at the evaluation (`train_s`: wall time since its first step, "
        "held-out evaluations left out; no start-up or profiling). "
        "Check: seconds to target against steps to target × median step, flagged beyond 10 %.",
        "",
    ]
    text = (
        "\n".join(header + lines)
        + f"\nFigure: {out.with_suffix('.png')}; every evaluation: {out.with_suffix('.csv')}.\n"
    )
    out.with_suffix(".md").write_text(text)
    print(text)
    log(t0, f"wrote {out.with_suffix('.md')}, .png and .csv")
    return 0 if all(math.isfinite(target) for _, target in per_workload.values()) else 1


if __name__ == "__main__":
    sys.exit(entry_point(main, "time_to_target"))
