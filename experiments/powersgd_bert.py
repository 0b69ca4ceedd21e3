"""PowerSGD on the BERT demo with 2 data-parallel copies: gradient bytes per step and loss after
the run, uncompressed against rank-R PowerSGD, over several seeds.

Every run is `pipefisher run schedules/tiny-cpu.yaml --data-parallel 2 --json` (BERT 4x128, 2
stages x 2 copies = 4 local processes, LAMB with warm-up 10, clipping) with run.seed = data.seed
= the seed; the compressed runs add `--powersgd-rank R` and `comm.powersgd_start_step` (default
10: compression starts after the warm-up, torch's advice). Reports per seed the final loss, the
mean loss of the last 20 steps, and the bytes rank 0 sent per step for the gradient reductions
(`grad_comm_bytes`) before and after the start step, against the factor expected from the
model's matrix shapes. Writes a Markdown table (--out) and the per-step losses (CSV beside it).

    PIPEFISHER_CACHE=/tmp/pfcache python experiments/powersgd_bert.py          # ~15 min on 2 cores
    PIPEFISHER_CACHE=/tmp/pfcache python experiments/powersgd_bert.py --steps 20 --seeds 0   # smoke
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: pipefisher and experiments

from experiments.common import experiment_output  # noqa: E402
from pipefisher.cli.scripts import entry_point  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BASE = ROOT / "schedules" / "tiny-cpu.yaml"


def run_file(folder: Path, seed: int, rank: int, start: int) -> Path:
    """The demo's run file with the seed and the compression settings."""
    data = yaml.safe_load(BASE.read_text())
    data["run"]["seed"] = seed
    data["data"]["seed"] = seed
    data.setdefault("comm", {}).update({"powersgd_rank": rank, "powersgd_start_step": start})
    path = folder / f"seed{seed}-rank{rank}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def train(path: Path, steps: int) -> list[dict]:
    """Run one training; its per-step JSON records."""
    command = [
        sys.executable,
        "-m",
        "pipefisher",
        "run",
        str(path),
        "--data-parallel",
        "2",
        "--steps",
        str(steps),
        "--json",
        "--master-port",
        "0",
    ]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def expected_factor(rank: int) -> float:
    """Compressed / uncompressed elements of the demo's stage 0 (rank 0's): P and Q of every
    matrix PowerSGD compresses, the rest whole."""
    from pipefisher.planning.comm.volume import powersgd_elements
    from pipefisher.config import load_config
    from pipefisher.runtime.training import build_run
    from pipefisher.runtime.training import unique_parameters

    config = load_config(BASE)
    stage = build_run(config).model.build_stage(0, config.pipeline.stages, seed=0)
    parameters = unique_parameters(stage)
    return sum(powersgd_elements(tuple(p.shape), rank) for p in parameters) / sum(p.numel() for p in parameters)


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=4, help="PowerSGD rank (default 4)")
    parser.add_argument("--start", type=int, default=10, help="comm.powersgd_start_step (default 10, the warm-up)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--out",
        default=str(experiment_output("powersgd_bert.md")),
        help=f"Markdown file to write (default {experiment_output('powersgd_bert.md')}; docs/performance.md's: docs/powersgd_bert.md)",
    )
    args = parser.parse_args()
    rows, curves = [], []
    with tempfile.TemporaryDirectory() as folder:
        for seed in args.seeds:
            runs = {}
            for rank in (0, args.rank):
                records = train(run_file(Path(folder), seed, rank, args.start), args.steps)
                runs[rank] = records
                curves += [(seed, rank, r["step"], r["loss"]) for r in records]
                print(f"seed {seed} rank {rank}: final loss {records[-1]['loss']:.4f}", file=sys.stderr, flush=True)
            plain, compressed = runs[0], runs[args.rank]
            tail = min(20, args.steps)
            rows.append(
                {
                    "seed": seed,
                    "final": (plain[-1]["loss"], compressed[-1]["loss"]),
                    "tail": (
                        statistics.mean(r["loss"] for r in plain[-tail:]),
                        statistics.mean(r["loss"] for r in compressed[-tail:]),
                    ),
                    "bytes": (
                        plain[-1]["grad_comm_bytes"],
                        compressed[0]["grad_comm_bytes"],
                        compressed[-1]["grad_comm_bytes"],
                    ),
                }
            )
    factor = expected_factor(args.rank)
    lines = [
        f"PowerSGD rank {args.rank} from step {args.start} on the BERT demo (`schedules/tiny-cpu.yaml`, 2 stages x 2 "
        f"data-parallel copies, LAMB), {args.steps} steps, seed = model and data seed. Bytes: what rank 0 (stage 0) "
        "sent per step for its gradient reduction (ring volume). Expected factor from the matrix shapes: "
        f"{factor:.4f}.",
        "",
        "| seed | final loss, uncompressed | final loss, PowerSGD | change | mean of last 20, uncompressed | PowerSGD | change "
        "| bytes/step uncompressed | PowerSGD before start | PowerSGD after | factor |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        (fp, fc), (tp, tc), (bp, b0, b1) = row["final"], row["tail"], row["bytes"]
        lines.append(
            f"| {row['seed']} | {fp:.4f} | {fc:.4f} | {100 * (fc - fp) / fp:+.2f} % | {tp:.4f} | {tc:.4f} | "
            f"{100 * (tc - tp) / tp:+.2f} % | {bp:,} | {b0:,} | {b1:,} | {b1 / bp:.4f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    with open(out.with_suffix(".csv"), "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["seed", "powersgd_rank", "step", "loss"])
        writer.writerows(curves)


if __name__ == "__main__":
    sys.exit(entry_point(main, "powersgd_bert"))
