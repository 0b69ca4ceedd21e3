"""Performance model (the PipeFisher paper's what-if figure) from per-block GPU profiles.

For each model, micro-batch size and pipeline depth D (N = D micro-batches, D stages of
blocks/D blocks), it simulates the first-order step, packs the K-FAC work and records: step time,
bubble time per device, curvature and inversion work per device and cycle, the lower bound
ceil(work / bubble) and the refresh interval the packer reaches (times in ms). Writes a CSV and
a PNG (refresh interval and packing overhead against micro-batch size, one line per depth, one
column per model). Small micro-batches leave bubbles too short for an inversion: such tasks do
not raise k but show up as overhead.

Usage: python experiments/perf_model.py [REFERENCE_FOLDER (default profiles/reference)] -o out/perf_model [--schedule 1f1b]
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: pipefisher and experiments

from experiments.common import experiment_output  # noqa: E402
from pipefisher.methods.registry import method_of_profile  # noqa: E402
from pipefisher.planning.packing.pack import pack  # noqa: E402
from pipefisher.planning.transformer_profile import BERT_SIZES, read_block_times, transformer_profile  # noqa: E402
from pipefisher.cli.scripts import entry_point  # noqa: E402
from pipefisher.schedules import get_schedule  # noqa: E402

DEPTHS = (2, 4, 8, 16)
MICRO_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
COLUMNS = [
    "model",
    "schedule",
    "micro_batch_size",
    "stages",
    "step_time_ms",
    "bubble_ms_per_device",
    "curvature_ms_per_device",
    "inversion_ms_per_device",
    "lower_bound",
    "refresh_steps",
    "overhead",
]


#: the PipeFisher authors' P100 block times shipped with the project
REFERENCE = Path(__file__).resolve().parents[1] / "profiles" / "reference"


def model_rows(reference: Path, schedule_name: str) -> list[dict]:
    rows = []
    for model, (blocks, hidden, ffn) in BERT_SIZES.items():
        for micro_batch_size in MICRO_BATCH_SIZES:
            times = read_block_times(reference / f"{model}_time_memory_p100.csv", micro_batch_size)
            for depth in DEPTHS:
                profile = transformer_profile(times, blocks, depth, hidden, ffn, micro_batch_size)
                schedule = get_schedule(schedule_name, depth, depth)
                result = pack(schedule, profile, method_of_profile(profile).rules)
                per_stage = profile.stages[0]
                rows.append(
                    {
                        "model": model,
                        "schedule": schedule_name,
                        "micro_batch_size": micro_batch_size,
                        "stages": depth,
                        "step_time_ms": round(result.first_order_step_time, 3),
                        "bubble_ms_per_device": round(result.first_order.bubble_time(0), 3),
                        "curvature_ms_per_device": round(per_stage.curvature_time * depth, 3),
                        "inversion_ms_per_device": round(per_stage.refresh_time, 3),
                        "lower_bound": result.lower_bound,
                        "refresh_steps": result.refresh_steps,
                        "overhead": round(result.overhead, 4),
                    }
                )
                print(
                    f"{model} bs={micro_batch_size:>2} D={depth:>2}: k={result.refresh_steps} (bound {result.lower_bound})",
                    flush=True,
                )
    return rows


def plot(rows: list[dict], path: Path) -> None:
    """Top row: refresh interval (dotted: lower bound); bottom row: packing overhead per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(BERT_SIZES)
    figure, axes = plt.subplots(2, len(models), figsize=(5.5 * len(models), 7), sharex=True, sharey="row")
    for column, model in enumerate(models):
        top, bottom = axes[0][column], axes[1][column]
        for depth in DEPTHS:
            selected = [r for r in rows if r["model"] == model and r["stages"] == depth]
            sizes = [r["micro_batch_size"] for r in selected]
            line = top.plot(sizes, [r["refresh_steps"] for r in selected], marker="o", label=f"D = N = {depth}")[0]
            top.plot(sizes, [r["lower_bound"] for r in selected], linestyle=":", color=line.get_color())
            bottom.plot(sizes, [100 * r["overhead"] for r in selected], marker="o", color=line.get_color())
        top.set_title(f"{model}, {rows[0]['schedule']} (P100 profile)")
        top.set_yscale("log", base=2)
        bottom.set_xscale("log", base=2)
        bottom.set_yscale("symlog", linthresh=1)
        bottom.set_xlabel("micro-batch size [sequences]")
        for axis in (top, bottom):
            axis.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("refresh interval k [steps]\n(dotted: lower bound)")
    axes[1][0].set_ylabel("packing overhead [% of step]")
    axes[0][-1].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "reference",
        type=Path,
        nargs="?",
        default=REFERENCE,
        help="folder with bert-{base,large}_time_memory_p100.csv (default: profiles/reference)",
    )
    parser.add_argument(
        "-o",
        "--output",
        type=Path,
        default=experiment_output("perf_model"),
        help=f"output path without suffix (default {experiment_output('perf_model')}; docs/packing.md's: docs/perf_model)",
    )
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "chimera"])
    args = parser.parse_args()
    rows = model_rows(args.reference, args.schedule)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with open(args.output.with_suffix(".csv"), "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, args.output.with_suffix(".png"))
    print(f"wrote {args.output.with_suffix('.csv')} and {args.output.with_suffix('.png')}")


if __name__ == "__main__":
    sys.exit(entry_point(main, "perf_model"))
