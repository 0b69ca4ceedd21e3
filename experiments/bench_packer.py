"""Packer benchmark on the PipeFisher reference GPU profiles (BERT blocks on a P100).

For BERT-Base and BERT-Large, micro-batch sizes 8 and 32, GPipe / 1F1B / Chimera, D = N in
{4, 8} (stages hold layers/D blocks), it packs the K-FAC work with (a) pipefisher's packer and
(b) the published PipeFisher greedy re-implemented (`--strategy published`), and reports (c) the
lower bound ceil(work / bubble). Per configuration: both default plans (k, overhead), whether
pipefisher's is dominated (published k <= ours and overhead <= ours, one strictly), and at every
k from 1 to the larger default k both plans pinned to that k (pipefisher's must never be slower).
Then the summary the README and docs/packing.md quote, and the packing time of D = 8, N = 128 (24 layers per stage).

Usage: python experiments/bench_packer.py [REFERENCE_FOLDER (default profiles/reference)] [--max-overhead 0.01] [--margin 0]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from pipefisher.methods.registry import method_of_profile
from pipefisher.planning.packing.pack import PackOptions, PackResult, pack
from pipefisher.planning.transformer_profile import BERT_SIZES, read_block_times, transformer_profile
from pipefisher.cli.scripts import entry_point
from pipefisher.schedules import get_schedule

#: the PipeFisher authors' P100 block times shipped with the project
REFERENCE = Path(__file__).resolve().parents[1] / "profiles" / "reference"
EXACT = 1e-9


def configurations(reference: Path):
    for model in ("bert-base", "bert-large"):
        blocks, hidden, ffn = BERT_SIZES[model]
        for micro_batch_size in (8, 32):
            times = read_block_times(reference / f"{model}_time_memory_p100.csv", micro_batch_size)
            for schedule_name in ("gpipe", "1f1b", "chimera"):
                for depth in (4, 8):
                    profile = transformer_profile(times, blocks, depth, hidden, ffn, micro_batch_size, device="P100")
                    yield (
                        (model, micro_batch_size, schedule_name, depth),
                        get_schedule(schedule_name, depth, depth),
                        profile,
                    )


def matched(schedule, profile, options: PackOptions, top: int) -> tuple[int, int]:
    """(k values where ours is not slower than the published rule's plan, k values compared)."""
    wins = 0
    for k in range(1, top + 1):
        ours = pack(schedule, profile, method_of_profile(profile).rules, replace(options, refresh_steps=k))
        published = pack(
            schedule, profile, method_of_profile(profile).rules, replace(options, refresh_steps=k, strategy="published")
        )
        wins += ours.step_time <= published.step_time * (1 + EXACT)
    return wins, top


def dominated(ours: PackResult, published: PackResult) -> bool:
    no_worse = published.refresh_steps <= ours.refresh_steps and published.overhead <= ours.overhead + EXACT
    better = published.refresh_steps < ours.refresh_steps or published.overhead < ours.overhead - EXACT
    return no_worse and better


def at_the_bound(result: PackResult) -> str:
    """The frontier's overhead at the lower bound: what k = bound would cost."""
    point = next((p for p in result.frontier if p.refresh_steps == result.lower_bound), None)
    return "-" if point is None else f"{100 * point.overhead:.2f} %"


def at_bound(result: PackResult, budget: float) -> bool:
    return result.refresh_steps <= result.lower_bound and result.overhead <= budget + EXACT


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
    parser.add_argument("--max-overhead", type=float, default=0.01)
    parser.add_argument("--margin", type=float, default=0.0)
    args = parser.parse_args()
    options = PackOptions(margin=args.margin, max_overhead=args.max_overhead)
    budget = args.max_overhead

    print(
        "| model | bs | schedule | D=N | lower bound | pipefisher k | overhead | published k | overhead | "
        "matched k not worse | dominated | pipefisher at the bound | why pipefisher's k |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for (model, bs, name, depth), schedule, profile in configurations(args.reference):
        ours = pack(schedule, profile, method_of_profile(profile).rules, options)
        published = pack(schedule, profile, method_of_profile(profile).rules, replace(options, strategy="published"))
        wins, compared = matched(schedule, profile, options, max(ours.refresh_steps, published.refresh_steps))
        rows.append((ours, published, wins == compared, dominated(ours, published)))
        print(
            f"| {model} | {bs} | {name} | {depth} | {ours.lower_bound} | {ours.refresh_steps} | {100 * ours.overhead:.2f} % | "
            f"{published.refresh_steps} | {100 * published.overhead:.2f} % | {wins}/{compared} | "
            f"{'yes' if rows[-1][3] else 'no'} | {at_the_bound(ours)} | {ours.reason.split(': ', 1)[1]} |",
            flush=True,
        )

    fits = [row for row in rows if not row[0].unplaceable]
    print()
    print(
        f"configurations: {len(rows)}; pipefisher not worse than the published rule at every matched k: "
        f"{sum(row[2] for row in rows)}; default dominated by the published rule's: {sum(row[3] for row in rows)}"
    )
    for label, group in (("all", rows), (f"the {len(fits)} where every task fits some bubble", fits)):
        bound = sum(r[0].lower_bound for r in group)
        ours_k = sum(r[0].refresh_steps for r in group)
        published_k = sum(r[1].refresh_steps for r in group)
        print(
            f"sum of refresh intervals ({label}): lower bound {bound}, pipefisher {ours_k} (+{100 * (ours_k / bound - 1):.1f} %), "
            f"published {published_k} (+{100 * (published_k / bound - 1):.1f} %); at the bound with <= {100 * budget:g} % overhead: "
            f"pipefisher {sum(at_bound(r[0], budget) for r in group)}, published {sum(at_bound(r[1], budget) for r in group)} of {len(group)}"
        )

    blocks, hidden, ffn = BERT_SIZES["bert-large"]
    times = read_block_times(args.reference / "bert-large_time_memory_p100.csv", 8)
    profile = transformer_profile(times, 32, 8, hidden, ffn, 8)  # 4 blocks = 24 layers per stage
    schedule = get_schedule("1f1b", 8, 128)
    durations = []
    for _ in range(5):
        start = time.perf_counter()
        result = pack(schedule, profile, method_of_profile(profile).rules, options)
        durations.append(time.perf_counter() - start)
    print(
        f"packing D=8, N=128, 24 layers per stage (1F1B): {statistics.median(durations):.2f} s "
        f"(median of 5), k={result.refresh_steps}"
    )


if __name__ == "__main__":
    sys.exit(entry_point(main, "bench_packer"))
