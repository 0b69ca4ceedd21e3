"""The simulator's caches give what simulating from scratch gives: a plan step's graph built on its
task graph's op numbers (`plan._step_graph`), and cost classes kept on an `OpDurations` across
simulations (`OpDurations.cost_classes`)."""

import pytest

from pipefisher.core.ir import Op, OpKind
from pipefisher.core.profile import ProfileError
from pipefisher.planning.packing.pack import PackOptions, pack
from pipefisher.planning.plan import simulate_plan, simulate_plan_step
from pipefisher.planning.simulate import OpDurations, simulate, simulate_graph, simulate_ops
from pipefisher.schedules import get_schedule
from pipefisher.schedules.validate import schedule_graph

from builders import layered_profile, rules_of


def _packed(name, d, n, strategy):
    schedule = get_schedule(name, d, n, None)
    profile = layered_profile(schedule.num_stages, sync=0.0, inverse=0.4)
    return profile, pack(schedule, profile, rules_of(profile), PackOptions(strategy=strategy)).plan


def _from_scratch(plan, index, profile, graph):
    """The step's timeline from per-op dependency lookups and fresh durations."""
    step = plan.steps[index]
    ops = {op for ops in step for op in ops}

    def deps(op):
        return tuple(dep for dep in graph.dependencies(op, index == 0) if dep in ops)

    return simulate_ops(step, deps, OpDurations(profile, plan.schedule.splits_backward), "x")


@pytest.mark.parametrize("strategy", ["fill", "published"])
@pytest.mark.parametrize("name, d, n", [("chimera", 4, 8), ("1f1b", 4, 4), ("zb-h1", 2, 4)])
def test_plan_steps_on_shared_numbers_and_durations_match_a_fresh_simulation(name, d, n, strategy):
    profile, plan = _packed(name, d, n, strategy)
    graph, durations = plan.graph, OpDurations(profile, plan.schedule.splits_backward)
    assert plan.refresh_steps >= 1
    for _ in range(2):  # the second pass runs on warm numbers and cost classes
        for index in range(plan.refresh_steps):
            assert simulate_plan_step(plan, index, durations, None, graph) == _from_scratch(plan, index, profile, graph)
    assert simulate_plan(plan, profile) == [
        _from_scratch(plan, index, profile, graph) for index in range(plan.refresh_steps)
    ]


def test_cost_classes_shared_across_schedules_match_fresh_durations():
    profile = layered_profile(4, sync=0.0, inverse=0.4)
    durations = OpDurations(profile)
    for name, n in [("gpipe", 8), ("1f1b", 4), ("chimera", 4), ("gpipe", 4)]:
        schedule = get_schedule(name, 4, n, None)
        assert simulate_graph(schedule_graph(schedule), durations, schedule.name) == simulate(schedule, profile)


def test_a_failed_lookup_leaves_the_cost_classes_usable():
    schedule = get_schedule("1f1b", 2, 4, None)
    profile = layered_profile(2, sync=0.0, inverse=0.4)
    durations = OpDurations(profile)
    unknown = Op(OpKind.REFRESH, 0, layer="no-such-layer", part=0)
    ranks = [list(schedule.ranks[0]) + [unknown], list(schedule.ranks[1])]
    with pytest.raises(ProfileError, match="no-such-layer"):
        simulate_ops(ranks, lambda op: (), durations)
    with pytest.raises(ProfileError, match="no-such-layer"):
        simulate_ops(ranks, lambda op: (), durations)
    assert len(durations.cost_classes.busy) == len(durations.cost_classes.classes)
    assert simulate_graph(schedule_graph(schedule), durations) == simulate(schedule, profile)
