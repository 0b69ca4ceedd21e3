"""Time planning: generating, validating and simulating a large schedule (default: 1F1B, D=64,
N=256), and packing the K-FAC work of BERT-Large on 1F1B with D=8, N=128 (4 blocks = 24 layers
per stage, block times of the PipeFisher P100 measurements, micro-batch 8).

Prints the median wall time of each phase over several repeats, in seconds.
Usage: python experiments/bench_planning.py [--schedule 1f1b] [--stages 64] [--micro-batches 256]
       [--reference profiles/reference] (no packing timing when the folder is missing)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from pathlib import Path

from pipefisher.methods.registry import method_of_profile
from pipefisher.core.profile import uniform_profile
from pipefisher.planning.packing.pack import pack
from pipefisher.planning.simulate import simulate
from pipefisher.planning.transformer_profile import BERT_SIZES, read_block_times, transformer_profile
from pipefisher.cli.scripts import entry_point
from pipefisher.schedules import get_schedule
from pipefisher.schedules.validate import validate


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--stages", type=int, default=64)
    parser.add_argument("--micro-batches", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--reference",
        type=Path,
        default=Path(__file__).resolve().parents[1] / "profiles" / "reference",
        help="folder with bert-large_time_memory_p100.csv (default: profiles/reference)",
    )
    args = parser.parse_args()
    phases: dict[str, list[float]] = {"generate": [], "validate": [], "simulate": [], "total": []}
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        schedule = get_schedule(args.schedule, args.stages, args.micro_batches)
        t1 = time.perf_counter()
        validate(schedule)
        t2 = time.perf_counter()
        timeline = simulate(schedule, uniform_profile(schedule.num_stages))
        t3 = time.perf_counter()
        for name, value in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
            phases[name].append(value)
    ops = sum(len(r) for r in schedule.ranks)
    print(
        f"{args.schedule} D={args.stages} N={args.micro_batches}: {ops} ops, step {timeline.step_time:g} units, "
        f"bubble {100 * timeline.bubble_fraction:.1f} %"
    )
    for name, values in phases.items():
        print(f"  {name:>8}: {statistics.median(values):.3f} s (median of {args.repeats})")
    csv = args.reference / "bert-large_time_memory_p100.csv"
    if not csv.exists():
        print(f"packing: skipped ({csv} not found)")
        return
    blocks, hidden, ffn = BERT_SIZES["bert-large"]
    profile = transformer_profile(read_block_times(csv, 8), 32, 8, hidden, ffn, 8)
    schedule = get_schedule("1f1b", 8, 128)
    durations = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        result = pack(schedule, profile, method_of_profile(profile).rules)
        durations.append(time.perf_counter() - start)
    print(
        f"packing BERT-Large 1F1B D=8 N=128 (24 layers per stage): {statistics.median(durations):.3f} s "
        f"(median of {args.repeats}), k={result.refresh_steps}"
    )


if __name__ == "__main__":
    sys.exit(entry_point(main, "bench_planning"))
