"""The capture cap's search over `until` (issue 46 item 5): captures held fall as `until` falls,
so the bisection in `fit_capture` picks the plan a scan from k - 1 down picks."""

import pytest

from pipefisher.planning.memory.captures import capture_peaks
from pipefisher.planning.packing.capture_cap import capped_builds, capped_plan
from pipefisher.planning.packing.pack import PackOptions, _Packing, choose, pack, packing_problem
from pipefisher.schedules import get_schedule

from builders import rules_of
from test_capture_memory import profile_with_captures

CASES = [("1f1b", 4, 8), ("gpipe", 4, 8), ("chimera", 4, 8), ("zb-h1", 4, 8), ("interleaved", 2, 8)]


def _peak(plan, profile) -> int:
    return max(p.bytes for p in capture_peaks(plan, profile))


@pytest.mark.parametrize("name, d, n", CASES)
def test_captures_fall_with_until_and_the_bisection_picks_what_a_scan_picks(name, d, n):
    schedule = get_schedule(name, d, n)
    profile = profile_with_captures(schedule.num_stages, inverse=8.0)
    rules = rules_of(profile)
    options = PackOptions()
    packing = _Packing(*packing_problem(schedule, profile, rules, options), options)
    chosen, _, _ = choose(packing, max(packing.bounds))
    k = chosen.refresh_steps
    assert k > 2, "a cycle long enough to bisect"
    peaks = []
    for until in range(k - 1, -2, -1):
        tail, spread = capped_builds(packing, k, until, ("tail", "spread"))
        assert _peak(tail.plan, profile) == _peak(spread.plan, profile), "captures do not depend on the leftovers"
        placed = packing.greedy("fill").run(k, curvature_until=until)
        assert _peak(packing.builder.capture_order(placed, k), profile) == _peak(tail.plan, profile)
        peaks.append(_peak(tail.plan, profile))
    assert peaks == sorted(peaks, reverse=True), "captures held never rise as until falls"
    assert peaks[0] > peaks[-1], "the case moves curvature"
    for cap in sorted(set(peaks)):
        scanned = next(until for until, peak in zip(range(k - 1, -2, -1), peaks) if peak <= cap)
        capped = pack(schedule, profile, rules, PackOptions(max_capture_mb=cap / 2**20 + 1e-9))
        expected = capped_plan(packing, k, scanned)
        if _peak(chosen.plan, profile) <= cap:
            expected = chosen  # the uncapped plan already fits
        assert capped.plan == expected.plan and capped.cycle_time == expected.cycle_time
