"""How much of a method's per-step work (its P ops: K-FAC's preconditioning, Muon's
orthogonalisation) the simulator puts where the first-order step is idle, from a profile.

Packs the profile's method for a schedule (median times), simulates the plan's first step and
the first-order step, and prints each P op's time and the part of it that overlaps the first-order
timeline's bubbles on its rank, then the step times and the share hidden.

Usage: python experiments/precondition_idle.py PROFILE [--schedule 1f1b] [--micro-batches 4]
"""

from __future__ import annotations

import argparse

from pipefisher.methods.registry import method_of_profile
from pipefisher.core.ir import OpKind
from pipefisher.core.profile import load_profile
from pipefisher.planning.packing.pack import PackOptions, pack
from pipefisher.planning.plan import simulate_plan
from pipefisher.planning.simulate import simulate
from pipefisher.schedules import SCHEDULES, get_schedule


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("profile", help="a pipefisher.profile/v1 file (`pipefisher profile`)")
    parser.add_argument("--schedule", choices=list(SCHEDULES), default="1f1b")
    parser.add_argument("--micro-batches", type=int, default=4)
    args = parser.parse_args()
    profile = load_profile(args.profile)
    schedule = get_schedule(args.schedule, len(profile.stages), args.micro_batches)
    first = simulate(schedule, profile)
    timeline = simulate_plan(
        pack(schedule, profile, method_of_profile(profile).rules, PackOptions(percentile=None)).plan, profile
    )[0]
    total = hidden = 0.0
    for rank, intervals in enumerate(timeline.ranks):
        idle = [(bubble.start, bubble.end) for bubble in first.bubbles(rank)]
        for interval in intervals:
            if interval.op.kind is OpKind.PRECONDITION:
                inside = sum(max(0.0, min(interval.end, end) - max(interval.start, start)) for start, end in idle)
                total, hidden = total + interval.duration, hidden + inside
                print(
                    f"rank {rank}: {interval.op} {interval.duration:.2f} {profile.time_unit}, {inside:.2f} of it in first-order idle time"
                )
    share = 100 * hidden / total if total else 0.0
    print(
        f"step: first-order {first.step_time:.1f} {profile.time_unit}, with the P ops {timeline.step_time:.1f} "
        f"(+{100 * (timeline.step_time / first.step_time - 1):.1f} %); P ops {total:.2f} per step, {share:.0f} % in idle time"
    )


if __name__ == "__main__":
    main()
