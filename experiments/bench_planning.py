"""Time generating, validating and simulating a large schedule (default: 1F1B, D=64, N=256).

Prints the median wall time of each phase over several repeats, in seconds.
Usage: python experiments/bench_planning.py [--schedule 1f1b] [--stages 64] [--micro-batches 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

from pipefisher.profile import uniform_profile
from pipefisher.schedules import get_schedule
from pipefisher.simulate import simulate
from pipefisher.validate import validate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--stages", type=int, default=64)
    parser.add_argument("--micro-batches", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
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
    print(f"{args.schedule} D={args.stages} N={args.micro_batches}: {ops} ops, step {timeline.step_time:g} units, "
          f"bubble {100 * timeline.bubble_fraction:.1f} %")
    for name, values in phases.items():
        print(f"  {name:>8}: {statistics.median(values):.3f} s (median of {args.repeats})")


if __name__ == "__main__":
    main()
