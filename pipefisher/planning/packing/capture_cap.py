"""The packer's capture cap (`PackOptions.max_capture_mb`): the chosen plan, or one whose curvature
runs earlier, in fewer of the cycle's steps, so that every device holds at most the cap of
captures (`pipefisher.planning.memory.captures`). Pure Python: no torch."""

from __future__ import annotations

from pipefisher.planning.memory.captures import CapturePeak, capture_peaks
from pipefisher.planning.packing.candidate import Candidate, Packing
from pipefisher.planning.packing.plan_builder import Built, Leftovers
from pipefisher.planning.packing.windows import Placed


def fit_capture(packing: Packing, chosen: Candidate, cap_bytes: int) -> tuple[Candidate, str, list[CapturePeak]]:
    """The chosen plan, or one whose curvature runs earlier so that every device holds at most
    `cap_bytes` of captures: `capped_plan` at the largest `until` in k - 1 .. -1 (-1: none in
    bubbles) whose captures fit; what was done; and the returned plan's `capture_peaks`.

    The captures a rank holds fall as `until` falls: the greedy is the same up to step `until`
    whatever comes after, so a smaller `until` keeps a prefix of the curvature the greedy placed
    and runs the rest right after its latest dependency, which is never later in the rank's order
    (a capture is held from its release to its curvature, in that order; where the other tasks
    go does not matter). So whether captures fit is monotone in `until`, and a bisection finds the
    largest that fits, the one a scan from k - 1 down finds (`tests/test_capture_cap_search.py`).

    Work shared, for the same answer: at `until` = k - 1 the greedy's steps < k are those of its
    full run (`Packing.placed`), which it reuses; a capped plan's peaks are those of its capture
    order (`PlanBuilder.capture_order` keeps every op the peaks read, in the same order)."""
    chosen_peaks = capture_peaks(chosen.plan, packing.tasks.profile)
    if _peak(chosen_peaks) <= cap_bytes:
        return chosen, "", chosen_peaks
    cap = f"{cap_bytes / 2**20:.1f} MiB"
    k = chosen.refresh_steps
    placements: dict[int, Placed] = {}
    peaks: dict[int, list[CapturePeak]] = {}

    def fits(until: int) -> bool:
        strategy = packing.options.strategy
        full = until == k - 1 and k <= packing.horizon
        placements[until] = packing.placed(strategy) if full else packing.greedy(strategy).run(k, curvature_until=until)
        peaks[until] = capture_peaks(packing.builder.capture_order(placements[until], k), packing.tasks.profile)
        return _peak(peaks[until]) <= cap_bytes

    low, high = -1, k - 1
    if not fits(high):
        while high - low > 1:  # high does not fit; low fits, or is -1 (asked last, if it is the answer)
            middle = (low + high) // 2
            low, high = (middle, high) if fits(middle) else (low, middle)
        if low == -1 and not fits(low):
            best = capped_plan(packing, k, low, placements[low])
            return (
                best,
                f"captures cannot fit {cap}: even with all curvature right after its forward/backward they peak at {_peak(peaks[low]) / 2**20:.1f} MiB",
                peaks[low],
            )
    else:
        low = high
    where = f"in steps <= {low}" if low >= 0 else "right after its forward/backward"
    how = "what misses the bubbles right after its latest dependency" if low >= 0 else "none in the bubbles"
    message = f"curvature {where} ({how}) to hold at most {cap} of captures"
    return capped_plan(packing, k, low, placements[low]), message, peaks[low]


def _peak(peaks: list[CapturePeak]) -> int:
    return max(p.bytes for p in peaks)


def capped_builds(
    packing: Packing, refresh_steps: int, until: int, policies: tuple[Leftovers, ...], placed: Placed | None = None
) -> list[Built]:
    """The plans with `refresh_steps` steps whose curvature the greedy places only in steps <=
    `until` (-1: none in bubbles), the rest right after its latest dependency; one per leftover
    policy. Their captures are the same: only the other tasks differ. (The greedy runs
    `refresh_steps` steps: what it would place later is not kept; `placed`: that run, where done.)
    Their order is correct by construction (`PlanBuilder`): one that deadlocks is a bug."""
    if placed is None:
        placed = packing.greedy(packing.options.strategy).run(refresh_steps, curvature_until=until)
    return [packing.builder.plan(placed, refresh_steps, policy, eager_curvature=True) for policy in policies]


def capped_plan(packing: Packing, refresh_steps: int, until: int, placed: Placed | None = None) -> Candidate:
    """The faster of `capped_builds`' plans with leftovers at the end and spread."""
    where = f"in steps <= {until}" if until >= 0 else "right after its forward/backward"
    source = f"{packing.options.strategy}, curvature {where}"
    candidates = [
        packing.evaluate(built, source)
        for built in capped_builds(packing, refresh_steps, until, ("tail", "spread"), placed)
    ]
    return min(candidates, key=lambda c: c.cycle_time)
