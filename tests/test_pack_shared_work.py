"""The packer's shared work gives what computing each piece afresh gives (issue 46 item 5, the
planner's speed): the eager curvature placement reused between a capture order and its plans,
the greedy's full run standing for its run up to k - 1, the capture peaks of the capture order
standing for the capped plan's, and a plan simulated on the packer's task graph."""

import pytest

from pipefisher.planning.memory.captures import capture_peaks
from pipefisher.planning.packing.capture_cap import capped_builds
from pipefisher.planning.packing.pack import PackOptions, _Packing, choose, pack, packing_problem
from pipefisher.planning.packing.plan_builder import PlanBuilder
from pipefisher.planning.plan import simulate_plan
from pipefisher.schedules import get_schedule

from builders import rules_of
from test_capture_memory import profile_with_captures

CASES = [("1f1b", 4, 8), ("gpipe", 4, 8), ("chimera", 4, 8), ("zb-h1", 4, 8), ("interleaved", 2, 8)]


def _packing(name: str, d: int, n: int):
    schedule = get_schedule(name, d, n)
    profile = profile_with_captures(schedule.num_stages, inverse=8.0)
    options = PackOptions()
    packing = _Packing(*packing_problem(schedule, profile, rules_of(profile), options), options)
    chosen, _, _ = choose(packing, max(packing.bounds))
    return schedule, profile, packing, chosen


@pytest.mark.parametrize("name, d, n", CASES)
def test_reused_eager_placement_and_full_run_give_the_plans_built_afresh(name, d, n):
    _, _, packing, chosen = _packing(name, d, n)
    k = chosen.refresh_steps
    for until in (k - 1, k // 2, -1):
        placed = packing.greedy("fill").run(k, curvature_until=until)
        order = packing.builder.capture_order(placed, k)  # leaves its eager placement for the plans below
        reused = capped_builds(packing, k, until, ("tail", "spread"), placed)
        for built in reused:  # the same peaks, after the same op of the same step
            assert capture_peaks(order, packing.tasks.profile) == capture_peaks(built.plan, packing.tasks.profile)
        fresh = [
            PlanBuilder(packing.tasks, packing.first_order, packing.windows).plan(
                placed, k, policy, eager_curvature=True
            )
            for policy in ("tail", "spread")
        ]
        assert reused == fresh
    full, truncated = packing.placed("fill"), packing.greedy("fill").run(k, curvature_until=k - 1)
    assert packing.builder.capture_order(full, k) == packing.builder.capture_order(truncated, k)
    for policy in ("tail", "spread"):
        assert packing.builder.plan(full, k, policy, eager_curvature=True) == packing.builder.plan(
            truncated, k, policy, eager_curvature=True
        )


@pytest.mark.parametrize("name, d, n", CASES)
def test_packed_capture_peaks_are_the_plans_own(name, d, n):
    schedule, profile, packing, chosen = _packing(name, d, n)
    uncapped = max(p.bytes for p in capture_peaks(chosen.plan, profile))
    moved = 0
    for share in (None, 1.0, 0.6, 0.3, 1e-9):
        cap = None if share is None else share * uncapped / 2**20
        result = pack(schedule, profile, rules_of(profile), PackOptions(max_capture_mb=cap))
        assert result.capture_peaks == tuple(capture_peaks(result.plan, profile))
        moved += bool(result.memory)
    assert moved >= 2, "the caps move curvature"


@pytest.mark.parametrize("name, d, n", CASES)
def test_a_plan_simulated_on_the_packers_graph_is_simulated_on_its_own(name, d, n):
    schedule, profile, _, chosen = _packing(name, d, n)
    for options in (
        PackOptions(),
        PackOptions(max_capture_mb=1e-6),
        PackOptions(refresh_steps=chosen.refresh_steps + 2),
    ):
        result = pack(schedule, profile, rules_of(profile), options)
        assert result.graph is not None
        assert simulate_plan(result.plan, profile, graph=result.graph) == simulate_plan(result.plan, profile)


def test_leftovers_follow_the_topological_order():
    _, _, packing, _ = _packing("1f1b", 4, 8)
    builder = packing.builder
    work = [op for op in builder.rank_of if op not in builder.collectives]
    assert builder.topological == sorted(work, key=builder._topological_key)
    assert builder.curvature_ops == [op for op in builder.topological if op.kind.name == "CURVATURE"]
