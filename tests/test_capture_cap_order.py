"""The capture cap's plans are in a correct order by construction (issue 46 item 7): every op
after all it waits for on its rank, and every group's collectives in one order on its ranks, so a
capped packing never deadlocks (the planner no longer retries one without the cap)."""

from dataclasses import replace

import pytest

from pipefisher.core.ir import OpKind
from pipefisher.core.topology import Topology
from pipefisher.planning.comm.plan import plan_actions
from pipefisher.planning.comm.replay import replay
from pipefisher.planning.packing.capture_cap import capped_builds
from pipefisher.planning.packing.pack import PackOptions, _Packing, pack, packing_problem
from pipefisher.planning.packing.windows import Placed, Placement, Slot
from pipefisher.planning.plan import validate_plan
from pipefisher.schedules import SCHEDULES, get_schedule

from builders import layered_profile, rules_of
from sweeps import micro_batches_for
from test_capture_memory import A, B, profile_with_captures


def zero_time_profile(num_stages: int, inverse: float = 0.4):
    """Curvature and B's inverses take no time (A's: `inverse`): ties everywhere in the plan's times."""
    return layered_profile(
        num_stages, 2, spread=False, curvature=0.0, inverse=inverse, inverse_b=0.0, capture_a_bytes=A, capture_b_bytes=B
    )


def test_spread_leftovers_sort_after_the_eager_curvature_they_wait_for_in_one_window():
    """A factor's chain placed in the last rank's window after its backwards but for its last
    micro-batch, at no time: that one goes right after it, eagerly, and so may the factor's
    inverse, a spread leftover, in the same window at the same time; it must sort after it."""
    schedule = get_schedule("1f1b", 4, 8)
    profile = zero_time_profile(4)
    options = PackOptions()
    packing = _Packing(*packing_problem(schedule, profile, rules_of(profile), options), options)
    tasks, rank = packing.tasks, schedule.num_ranks - 1
    layer = tasks.cycle[rank][0].layer
    chain = [op for op in tasks.cycle[rank] if op.kind is OpKind.CURVATURE and op.part == 1 and op.layer == layer]
    backwards_end = max(iv.end for iv in packing.first_order.ranks[rank])
    window = next(start for start, _ in packing.windows.free[rank] if start >= backwards_end)
    placed = Placed({op: Placement(Slot(0, window, 1, i), window, window) for i, op in enumerate(chain[:-1])})
    plan = packing.builder.plan(placed, 1, "spread", eager_curvature=True).plan
    order = plan.steps[0][rank]
    inverse = next(op for op in order if op.kind is OpKind.REFRESH and op.layer == layer and op.part == 1)
    assert order.index(chain[-1]) < order.index(inverse)
    validate_plan(plan)


@pytest.mark.parametrize("zero_time", [False, True], ids=["timed", "zero-time"])
def test_eager_curvature_in_a_window_runs_after_what_it_holds_so_syncs_go_in_the_ranks_order(zero_time):
    """One factor's chain but its last micro-batch, then another layer's, then that layer's
    inverse, in the last rank's window after its backwards (data-parallel: the factors are
    synced). The first factor's last micro-batch goes eagerly at the window's end, after the
    inverse: its sync must come after the other layer's, else that one waits behind it (timed:
    the eager task's time follows the window's; zero-time: both syncs are ready at once)."""
    schedule = get_schedule("1f1b", 4, 8)
    profile = zero_time_profile(4, inverse=0.0) if zero_time else profile_with_captures(4)
    options = PackOptions(data_parallel=2)
    packing = _Packing(*packing_problem(schedule, profile, rules_of(profile), options), options)
    tasks, rank = packing.tasks, schedule.num_ranks - 1
    layers = sorted({op.layer for op in tasks.cycle[rank] if op.kind is OpKind.CURVATURE})
    chains = [
        [op for op in tasks.cycle[rank] if op.kind is OpKind.CURVATURE and op.part == 0 and op.layer == layer]
        for layer in layers[:2]
    ]
    inverse = next(
        op for op in tasks.cycle[rank] if op.kind is OpKind.REFRESH and op.part == 0 and op.layer == layers[1]
    )
    backwards_end = max(iv.end for iv in packing.first_order.ranks[rank])
    window = next(start for start, _ in packing.windows.free[rank] if start >= backwards_end)
    placed, time = {}, window
    for sequence, op in enumerate(chains[0][:-1] + chains[1] + [inverse]):
        placed[op] = Placement(Slot(0, window, 1, sequence), time, time + tasks.durations(op))
        time = placed[op].end
    for policy in ("tail", "spread"):
        plan = packing.builder.plan(Placed(placed), 1, policy, eager_curvature=True).plan
        validate_plan(plan)
        replay(plan_actions(Topology(schedule, 2), plan))


def test_a_leftover_ready_at_a_steps_end_goes_in_no_earlier_step():
    """ZBV's zero-time curvature the published rule puts at the very start of step 1: the inverse
    waiting for it is ready exactly at step 0's end, and must not run after step 0's work."""
    schedule = get_schedule("zbv", 2, 4)
    profile = zero_time_profile(schedule.num_stages)
    for data_parallel in (1, 2):  # (2: through the factors' syncs)
        options = PackOptions(strategy="published", data_parallel=data_parallel)
        packing = _Packing(*packing_problem(schedule, profile, rules_of(profile), options), options)
        (spread,) = capped_builds(packing, 2, 1, ("spread",))
        validate_plan(spread.plan)


CASES = [
    pytest.param(name, strategy, id=f"{name}-{strategy}") for name in SCHEDULES for strategy in ("fill", "published")
]


@pytest.mark.parametrize("name, strategy", CASES)
def test_capped_plans_of_every_schedule_raise_nothing_and_replay(name, strategy):
    """Every registered schedule, task times alike and some zero: every plan the cap may choose
    at k = 4 (each `until`, leftovers at the end and spread), and `pack` with caps at half the
    uncapped peak and below any plan's, validate and replay under NCCL's in-order rule."""
    schedule = get_schedule(name, 4, micro_batches_for(name, 4, at_least=4))
    moved = 0
    replayed: set[tuple] = set()  # (each distinct plan once)

    def check(plan, data_parallel: int) -> None:
        if (plan.steps, data_parallel) not in replayed:
            replayed.add((plan.steps, data_parallel))
            validate_plan(plan)
            replay(plan_actions(Topology(plan.schedule, data_parallel), plan))

    for profile, data_parallel in (
        (profile_with_captures(schedule.num_stages), 2),
        (zero_time_profile(schedule.num_stages), 1),
    ):
        rules = rules_of(profile)
        options = PackOptions(data_parallel=data_parallel, strategy=strategy)
        packing = _Packing(*packing_problem(schedule, profile, rules, options), options)
        for until in range(3, -2, -1):
            for built in capped_builds(packing, 4, until, ("tail", "spread")):
                check(built.plan, data_parallel)
        uncapped = pack(schedule, profile, rules, options)
        for share in (0.5, 1e-6):
            cap = share * uncapped.capture_peak_bytes / 2**20
            result = pack(schedule, profile, rules, replace(options, max_capture_mb=cap))
            moved += bool(result.memory)
            check(result.plan, data_parallel)
    assert moved == 4, "every cap moves curvature"
    assert len(replayed) > 4, "the untils give other plans"
