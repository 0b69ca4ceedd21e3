"""Packer benchmark on the PipeFisher reference GPU profiles (BERT blocks on a P100).

For BERT-Base and BERT-Large, micro-batch sizes 8 and 32, GPipe / 1F1B / Chimera, D = N in
{4, 8} (stages hold layers/D blocks), it packs the K-FAC work with (a) pipefisher's packer,
(b) the published PipeFisher greedy re-implemented (`--strategy published`) and reports
(c) the lower bound ceil(work / bubble). Prints a markdown table and the summary the README
quotes, and the packing time of the largest case (D = 8, N = 32, 24 layers per stage).

Usage: python experiments/bench_packer.py ../shared/reference [--max-overhead 0.01] [--margin 0.05]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from pipefisher.pack import PackOptions, PackResult, pack
from pipefisher.schedules import get_schedule
from pipefisher.transformer_profile import BERT_SIZES, read_block_times, transformer_profile


def run(reference: Path, options: PackOptions) -> list[dict]:
    rows = []
    for model in ("bert-base", "bert-large"):
        blocks, hidden, ffn = BERT_SIZES[model]
        for micro_batch_size in (8, 32):
            times = read_block_times(reference / f"{model}_time_memory_p100.csv", micro_batch_size)
            for schedule_name in ("gpipe", "1f1b", "chimera"):
                for depth in (4, 8):
                    profile = transformer_profile(times, blocks, depth, hidden, ffn, micro_batch_size, device="P100")
                    schedule = get_schedule(schedule_name, depth, depth)
                    ours = pack(schedule, profile, options)
                    published = pack(schedule, profile, PackOptions(**{**options.__dict__, "strategy": "published"}))
                    rows.append(
                        {
                            "model": model,
                            "bs": micro_batch_size,
                            "schedule": schedule_name,
                            "D": depth,
                            "ours": ours,
                            "published": published,
                        }
                    )
    return rows


def at_bound(result: PackResult, budget: float) -> bool:
    return result.refresh_steps <= result.lower_bound and result.overhead <= budget + 1e-12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reference", type=Path, help="folder with bert-{base,large}_time_memory_p100.csv")
    parser.add_argument("--max-overhead", type=float, default=0.01)
    parser.add_argument("--margin", type=float, default=0.05)
    args = parser.parse_args()
    options = PackOptions(margin=args.margin, max_overhead=args.max_overhead)
    rows = run(args.reference, options)

    print("| model | bs | schedule | D=N | lower bound | pipefisher k | overhead | published k | overhead | ours not worse |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    not_worse = 0
    for row in rows:
        ours, published = row["ours"], row["published"]
        ok = ours.refresh_steps <= published.refresh_steps and ours.overhead <= published.overhead + 1e-9
        not_worse += ok
        print(
            f"| {row['model']} | {row['bs']} | {row['schedule']} | {row['D']} | {ours.lower_bound} | "
            f"{ours.refresh_steps} | {100 * ours.overhead:.2f} % | {published.refresh_steps} | "
            f"{100 * published.overhead:.2f} % | {'yes' if ok else 'no'} |"
        )
    bound = sum(r["ours"].lower_bound for r in rows)
    ours_k = sum(r["ours"].refresh_steps for r in rows)
    published_k = sum(r["published"].refresh_steps for r in rows)
    print()
    print(f"configurations: {len(rows)}; pipefisher not worse than published in both numbers: {not_worse}")
    print(f"sum of refresh intervals: lower bound {bound}, pipefisher {ours_k} (+{100 * (ours_k / bound - 1):.1f} %), "
          f"published {published_k} (+{100 * (published_k / bound - 1):.1f} %)")
    budget = args.max_overhead
    print(f"at the bound with <= {100 * budget:g} % overhead: pipefisher {sum(at_bound(r['ours'], budget) for r in rows)}, "
          f"published {sum(at_bound(r['published'], budget) for r in rows)} of {len(rows)}")

    blocks, hidden, ffn = BERT_SIZES["bert-large"]
    times = read_block_times(args.reference / "bert-large_time_memory_p100.csv", 8)
    profile = transformer_profile(times, 32, 8, hidden, ffn, 8)  # 4 blocks = 24 layers per stage
    schedule = get_schedule("1f1b", 8, 32)
    durations = []
    for _ in range(3):
        start = time.perf_counter()
        result = pack(schedule, profile, options)
        durations.append(time.perf_counter() - start)
    print(f"packing D=8, N=32, 24 layers per stage (1F1B): {statistics.median(durations):.2f} s "
          f"(median of 3), k={result.refresh_steps}")


if __name__ == "__main__":
    main()
