"""Training on a fixed wall-clock budget in one process (issue 47, item 4): AdamW, Muon and SOAP
(--methods) each train the same run for --budget seconds of training, one after the other, one
seed. `run.time_budget_s` ends each run after the step that passes the budget (`train_s`: wall
seconds since the first step, held-out evaluation left out; start-up is not in it).

Each method first runs --calibrate steps without evaluation to measure its median step; its
timed run then gets run.steps = budget / that step, so that its learning-rate schedule (warm-up
over 5 % of it, then linear decay) ends near the budget, and the budget ends it at the latest.
Held-out loss --evals times per run and after its last step. Report: per method the steps it
took, its median step, tokens/s, final held-out loss, and the training seconds at which it first
reached the first method's (AdamW's) final held-out loss (linear between evaluations), with the
ratio to the first method's own; OUT.md, OUT.csv (every evaluation), OUT.png (loss vs seconds).

Corpus: the Python sources of the installed packages (`--source-mb` of them, as a JSON-lines file
of one document per file under --cache), byte-level BPE of 8,000 tokens, 2 % of the documents
held out: a text that does not repeat within the budget and needs no network. Code, not prose:
say so with the numbers. Learning rates are not tuned (--lr): a single-seed demonstration.

Default: GPT-2 124M (12 x 768, 1,024 tokens per sequence), 4 micro-batches of 8 sequences per
step (32,768 tokens), bf16, one stage, 150 s per method: about 11 minutes on one H100/H200 with
start-up and calibration. On a CPU, --quick (GPT-2 tiny, 64 tokens, 20 s per method).

    python experiments/time_budget.py --out /tmp/budget               # on a machine with a GPU
    python experiments/time_budget.py --quick --out /tmp/budget-quick  # on a CPU, about 3 minutes
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: pipefisher and experiments

from experiments.common import UsageError, checked, experiment_output, listed, progress, run_child  # noqa: E402
from experiments.convergence_study.report import first_crossing  # noqa: E402
from experiments.time_to_target_study.report import final  # noqa: E402
from experiments.time_to_target_study.runs import WARMUP, PipelinedRun, parse_records  # noqa: E402
from pipefisher.cli.scripts import entry_point  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RUN_FILE = ROOT / "schedules" / "gpt2-tiny-shards.yaml"
LEARNING_RATES = {"adamw": 6e-4, "muon": 0.02, "soap": 3e-3, "kfac": 0.05, "shampoo": 1e-3, "lamb": 6e-3}


@dataclass(frozen=True)
class Size:
    """The model and batch of the study: `hf_config`, tokens per sequence, sequences per
    micro-batch, micro-batches per step, `precision`."""

    hf_config: str
    seq_len: int
    micro_batch_size: int
    micro_batches: int
    precision: str

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.micro_batch_size * self.micro_batches


GPU_SIZE = Size("gpt2", 1024, 8, 4, "bf16")
CPU_SIZE = Size("gpt2-tiny", 64, 8, 4, "fp32")


def source_corpus(cache: Path, megabytes: float) -> Path:
    """A JSON-lines file under `cache` of the installed packages' `.py` files (one document each,
    in path order) up to `megabytes` MB of text; written once."""
    path = cache / f"python-sources-{megabytes:g}mb.jsonl"
    if path.is_file():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    budget, partial = megabytes * 1e6, path.with_suffix(".tmp")
    with partial.open("w") as out:
        for source in sorted(Path(sysconfig.get_paths()["purelib"]).rglob("*.py")):
            text = source.read_text(errors="replace").strip()
            if len(text) < 200:
                continue
            out.write(json.dumps({"text": text}) + "\n")
            budget -= len(text)
            if budget <= 0:
                break
    partial.replace(path)
    return path


def prepared_shards(cache: Path, megabytes: float) -> Path:
    """Token shards of `source_corpus` (BPE, 8,000 tokens, 2 % held out), prepared once."""
    folder = cache / f"shards-python-{megabytes:g}mb"
    if not (folder / "manifest.json").is_file():
        command = [sys.executable, "-m", "pipefisher", "data", "prepare", str(source_corpus(cache, megabytes))]
        command += ["-o", str(folder), "--tokenizer", "bpe", "--vocab-size", "8000", "--holdout", "0.02"]
        checked(run_child(command + ["--overwrite"], cwd=ROOT), command)
    return folder


def command(method: str, lr: dict[str, float], size: Size, shards: Path, steps: int, metrics: Path) -> list[str]:
    """The one-stage `pipefisher run` of `method` for `steps` steps, its records to `metrics`."""
    keys: dict[str, object] = {
        "model.hf_config": size.hf_config,
        "model.seq_len": size.seq_len,
        "data.shards": shards,
        "data.micro_batch_size": size.micro_batch_size,
        "pipeline.stages": 1,
        "pipeline.micro_batches": size.micro_batches,
        "run.precision": size.precision,
        "run.tensorboard": "",
        "run.eval_batches": 8,
        "optimizer.lr": lr["adamw"],
        "optimizer.warmup_steps": max(1, steps // 20),
    }
    if method != "adamw":
        keys[f"{method}.lr"] = lr[method]
        keys[f"{method}.placement"] = "after-step"  # one stage: no bubble to pack into
    argv = [sys.executable, "-m", "pipefisher", "run", str(RUN_FILE), "--steps", str(steps), "--optimizer", method]
    argv += ["--master-port", "0", "--metrics", str(metrics)]
    return argv + [item for key, value in keys.items() for item in (f"--{key}", str(value))]


def train(argv: list[str]) -> tuple[list[dict], float]:
    """Run `argv` (a `command` whose --metrics it reads back); its step records and wall seconds."""
    metrics = Path(argv[argv.index("--metrics") + 1])
    start = time.perf_counter()
    checked(run_child(argv, cwd=ROOT, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"}), argv)
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return records, time.perf_counter() - start


def budget_run(method: str, args: argparse.Namespace, size: Size, shards: Path, folder: Path) -> PipelinedRun:
    """Calibrate `method`'s step, then train it on the budget with evaluations."""
    lr = {**LEARNING_RATES, **args.lr}
    calibration, _ = train(command(method, lr, size, shards, args.calibrate, folder / f"{method}-calibration.jsonl"))
    step_s = statistics.median(float(r["step_time_ms"]) for r in calibration[WARMUP:]) / 1000
    steps = max(args.calibrate, round(args.budget / step_s))
    argv = command(method, lr, size, shards, steps, folder / f"{method}.jsonl")
    argv += ["--time-budget", str(args.budget), "--run.eval_every", str(max(1, steps // args.evals))]
    progress(f"{method}: {step_s * 1000:.1f} ms per step calibrated; a budget of {args.budget:g} s holds {steps} steps")
    records, wall = train(argv)
    progress(f"{method}: {len(records)} of {steps} steps, {wall:.0f} s with start-up")
    return parse_records(records, wall)


def report(runs: dict[str, PipelinedRun], args: argparse.Namespace, size: Size) -> str:
    """The study's table (markdown), the first method as the reference."""
    first = next(iter(runs))
    target = final(runs[first])
    reference = first_crossing(runs[first].clock, target)
    lines = [
        f"# Training on a budget of {args.budget:g} s per method, one process",
        "",
        f"Command: `python experiments/time_budget.py {' '.join(sys.argv[1:])}`",
        "",
        f"{size.hf_config}, {size.micro_batches} micro-batches of {size.micro_batch_size} x {size.seq_len} tokens "
        f"({size.tokens_per_step:,} per step), {size.precision}, one stage; Python sources of the installed packages "
        f"({args.source_mb:g} MB, BPE 8,000), one seed, learning rates not tuned. Target: {first}'s final held-out "
        f"loss, {target:.4f}.",
        "",
        f"| method | lr | steps | median step [ms] | tokens/s | final held-out loss | seconds to {target:.4f} | x {first} |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lr = {**LEARNING_RATES, **args.lr}
    for method, run in runs.items():
        seconds = first_crossing(run.clock, target)
        reached = f"{seconds:.1f} | {seconds / reference:.2f}" if math.isfinite(seconds) else "not reached | –"
        lines.append(
            f"| {method} | {lr[method]:g} | {len(run.step_ms)} | {run.median_step_ms:.1f} | "
            f"{size.tokens_per_step / run.median_step_ms * 1000:,.0f} | {final(run):.4f} | {reached} |"
        )
    return "\n".join(lines) + "\n"


def write_outputs(runs: dict[str, PipelinedRun], text: str, out: Path) -> None:
    """OUT.md (`text`), OUT.csv (method, steps done, train seconds, held-out loss), OUT.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text)
    with out.with_suffix(".csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["method", "step", "train_s", "eval_loss"])
        for method, run in runs.items():
            for (step, loss), (seconds, _) in zip(run.evals, run.clock):
                writer.writerow([method, step, f"{seconds:.3f}", f"{loss:.6f}"])
    figure, axis = plt.subplots(figsize=(6, 4))
    for method, run in runs.items():
        axis.plot([s for s, _ in run.clock], [loss for _, loss in run.clock], marker="o", label=method)
    axis.set_xlabel("training seconds")
    axis.set_ylabel("held-out loss")
    axis.legend()
    figure.tight_layout()
    figure.savefig(out.with_suffix(".png"), dpi=120)
    plt.close(figure)


def _rates(text: str) -> dict[str, float]:
    """`adamw=6e-4,muon=0.02` as a dict (argparse type)."""
    try:
        return {name: float(value) for name, value in (item.split("=") for item in text.split(",") if item)}
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give METHOD=LR pairs, comma-separated") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--methods", default="adamw,muon,soap", help="comma-separated, the first is the reference")
    parser.add_argument("--budget", type=float, default=None, help="seconds of training per method (150; --quick 20)")
    parser.add_argument("--calibrate", type=int, default=12, help="steps of each method's calibration run (>= 8)")
    parser.add_argument(
        "--evals", type=int, default=10, help="held-out evaluations per run (and one after the last step)"
    )
    parser.add_argument("--lr", type=_rates, default={}, help="METHOD=LR pairs replacing the defaults")
    parser.add_argument("--source-mb", type=float, default=None, help="MB of source text (80; --quick 4)")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "pipefisher-time-budget")
    parser.add_argument("--quick", action="store_true", help="GPT-2 tiny in fp32: a CPU smoke run")
    default_out = experiment_output("time_budget")
    parser.add_argument(
        "--out", type=Path, default=default_out, help=f"OUT.md, OUT.csv, OUT.png (default {default_out})"
    )
    args = parser.parse_args(argv)
    try:
        methods = listed(args.methods, LEARNING_RATES, "--methods")
    except UsageError as exc:
        parser.error(str(exc))
    if args.calibrate < WARMUP + 4:
        parser.error(
            f"--calibrate: {args.calibrate} is too few; give at least {WARMUP + 4} (the first {WARMUP} are not timed)"
        )
    args.budget = args.budget or (20.0 if args.quick else 150.0)
    args.source_mb = args.source_mb or (4.0 if args.quick else 80.0)
    size = CPU_SIZE if args.quick else GPU_SIZE
    shards = prepared_shards(args.cache, args.source_mb)
    folder = args.out.parent / f"{args.out.name}-records"
    folder.mkdir(parents=True, exist_ok=True)
    runs = {method: budget_run(method, args, size, shards, folder) for method in methods}
    text = report(runs, args, size)
    write_outputs(runs, text, args.out)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(entry_point(main, "time_budget"))
