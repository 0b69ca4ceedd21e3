"""The greedy packer's gap to the exact optimum (`pipefisher.planning.packing.exact`, HiGHS) on the
24 configurations of `bench_packer.py` (the PipeFisher authors' P100 BERT profiles): per
configuration the greedy's default k and overhead, the exact solver's smallest k within the same
budget and its least overhead there, the greedy's overhead pinned to that k, and the solve time.
A configuration whose model needs more binary variables than --max-binaries is skipped (noted).
Needs the ``solver`` extra.

Usage: python experiments/packer_gap.py [--time-limit 20] [--max-binaries 40000] [--max-overhead 0.01]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: pipefisher and experiments

from experiments.bench_packer import REFERENCE, configurations  # noqa: E402
from pipefisher.cli.scripts import entry_point  # noqa: E402
from pipefisher.methods.registry import method_of_profile  # noqa: E402
from pipefisher.planning.packing.exact import solve_cycle  # noqa: E402
from pipefisher.planning.packing.pack import PackOptions, pack  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--time-limit", type=float, default=20.0, help="seconds per solve of one k")
    parser.add_argument("--max-binaries", type=int, default=40000)
    parser.add_argument("--max-overhead", type=float, default=0.01)
    args = parser.parse_args()
    options = PackOptions(max_overhead=args.max_overhead)
    header = [
        "| model | bs | schedule | D=N | lower bound | greedy k | greedy overhead | exact k | exact overhead "
        "| greedy at exact k | optimal | binaries | solve [s] |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(header), flush=True)
    for (model, bs, name, depth), schedule, profile in tqdm(list(configurations(REFERENCE)), desc="configurations"):
        rules = method_of_profile(profile).rules
        greedy = pack(schedule, profile, rules, options)
        row = f"| {model} | {bs} | {name} | {depth} | {greedy.lower_bound} | {greedy.refresh_steps} | {100 * greedy.overhead:.2f} % |"
        try:
            exact = solve_cycle(
                schedule, profile, rules, options, time_limit=args.time_limit, max_binaries=args.max_binaries
            )
        except ValueError as exc:
            tqdm.write(f"{row} skipped: {exc} | | | | | |")
            continue
        pinned = pack(schedule, profile, rules, replace(options, refresh_steps=exact.refresh_steps))
        tqdm.write(
            f"{row} {exact.refresh_steps}{'' if exact.fits else ' (no k fits)'} | {100 * exact.overhead:.2f} % | "
            f"{100 * pinned.overhead:.2f} % | {'yes' if exact.optimal else 'time limit'} | {exact.binaries} | {exact.seconds:.1f} |"
        )


if __name__ == "__main__":
    sys.exit(entry_point(main, "packer_gap"))
