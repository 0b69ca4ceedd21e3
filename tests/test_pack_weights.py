"""The packer on schedules that split the backward (W ops): plans validate with W where the
schedule put it, and with W moved within its step (after its B, before its stage's precondition,
within the schedule's own memory), never predicted slower than with W fixed."""

from collections import Counter
from dataclasses import replace

import pytest

from pipefisher.planning.memory.captures import capture_peaks
from pipefisher.planning.comm.plan import plan_actions
from pipefisher.planning.comm.replay import replay
from pipefisher.core.ir import (
    Op,
    OpKind,
    Schedule,
    ScheduleError,
    peak_activations,
    peak_pending_weights,
    weight,
)
from pipefisher.core.profile import LayerProfile, Profile, StageProfile
from pipefisher.core.topology import Topology
from pipefisher.methods.registry import task_rules
from pipefisher.planning.packing.pack import PackOptions, after_step_plan, pack
from pipefisher.planning.plan import Plan, moved_weights, validate_plan
from pipefisher.planning.simulate import COLLECTIVES
from pipefisher.planning.tasks import CYCLE_KINDS, TaskGraph, build_tasks
from pipefisher.schedules import get_schedule

from builders import layered_profile, rules_of


def weights_after_backwards(schedule: Schedule) -> Schedule:
    """The schedule with each B followed by its W (1F1B's memory, its bubbles)."""
    ranks = [
        [
            new
            for op in ops
            for new in ((op, weight(op.stage, op.micro_batch, op.pipe)) if op.kind is OpKind.BACKWARD else (op,))
        ]
        for ops in schedule.ranks
    ]
    return schedule.with_ranks(ranks, name=f"{schedule.name}+w")


def weights_at_the_end(schedule: Schedule) -> Schedule:
    """The schedule with every W deferred to the end of its rank's list (cool-down)."""
    ranks = [
        list(ops) + [weight(op.stage, op.micro_batch, op.pipe) for op in ops if op.kind is OpKind.BACKWARD]
        for ops in schedule.ranks
    ]
    return schedule.with_ranks(ranks, name=f"{schedule.name}+w-late")


SCHEDULES = {
    "zb-h1 4x8": lambda: get_schedule("zb-h1", 4, 8),
    "zbv 2x4": lambda: get_schedule("zbv", 2, 4),
    "dualpipev 4x8": lambda: get_schedule("dualpipev", 4, 8),
    "1f1b+w 4x8": lambda: weights_after_backwards(get_schedule("1f1b", 4, 8)),
    "1f1b+w-late 3x6": lambda: weights_at_the_end(get_schedule("1f1b", 3, 6)),
    "gpipe+w 2x4": lambda: weights_after_backwards(get_schedule("gpipe", 2, 4)),
    "interleaved+w 2x4": lambda: weights_after_backwards(get_schedule("interleaved", 2, 4, 2)),
    "chimera+w 4x4": lambda: weights_after_backwards(get_schedule("chimera", 4, 4)),
}


#: (schedule, refresh_steps) where `profile_for`'s packed plan must move W ops (with them fixed,
#: its curvature would run after the step's work)
MUST_MOVE = {("1f1b+w-late 3x6", None), ("1f1b+w-late 3x6", 2)}


def profile_for(num_stages, layers=3, inverse=0.4, weight_time=1.0, sync=0.1, method="kfac", grad_reduce=0.0):
    """Forward 1, backward 2 (of which `weight_time` the weight gradient); layer sizes vary."""
    return layered_profile(
        num_stages, layers, inverse=inverse, weight=weight_time, sync=sync, method=method, grad_reduce=grad_reduce
    )


def check_weights(plan: Plan) -> None:
    """Every step runs each W of the schedule once on its rank, after its B, before its stage's
    precondition, holding no more than the schedule does."""
    schedule = plan.schedule
    for step in plan.steps:
        for rank, ops in enumerate(step):
            own = schedule.ranks[rank]
            assert Counter(op for op in ops if op.kind is OpKind.WEIGHT) == Counter(
                op for op in own if op.kind is OpKind.WEIGHT
            )
            position = {op: i for i, op in enumerate(ops)}
            for op in ops:
                if op.kind is OpKind.WEIGHT:
                    assert position[Op(OpKind.BACKWARD, op.stage, op.micro_batch, op.pipe)] < position[op]
                    precondition = Op(OpKind.PRECONDITION, op.stage, None, op.pipe)
                    assert position.get(precondition, len(ops)) > position[op]
            assert peak_pending_weights(ops) <= peak_pending_weights(own)
            assert peak_activations(ops) <= peak_activations(own)


def check_timelines(plan: Plan, timelines, tasks) -> None:
    """Predicted times respect every dependency, within and across ranks."""
    graph = plan.graph
    for index, timeline in enumerate(timelines):
        end = {iv.op: iv.end for ivs in timeline.ranks for iv in ivs}
        start = {iv.op: iv.start for ivs in timeline.ranks for iv in ivs}
        for ivs in timeline.ranks:
            for a, b in zip(ivs, ivs[1:]):
                assert a.end <= b.start + 1e-9
            for iv in ivs:
                for dep in graph.dependencies(iv.op, first_step=index == 0):
                    if dep in end:
                        delay = tasks.durations.work(dep) if dep.kind in COLLECTIVES else 0.0
                        assert end[dep] + delay <= start[iv.op] + 1e-9


@pytest.mark.parametrize("refresh_steps", [None, 1, 2])
@pytest.mark.parametrize(
    "options",
    [dict(move_weights=False), dict(), dict(strategy="published"), dict(split=False)],
    ids=["fixed", "movable", "published", "unsplit"],
)
@pytest.mark.parametrize("name", SCHEDULES)
def test_plans_of_weight_schedules_are_valid_and_complete(name, options, refresh_steps):
    schedule = SCHEDULES[name]()
    profile = profile_for(schedule.num_stages)
    result = pack(schedule, profile, rules_of(profile), PackOptions(refresh_steps=refresh_steps, **options))
    plan = validate_plan(result.plan)
    tasks = build_tasks(schedule, profile, rules_of(profile), split=options.get("split", True))
    assert Counter(op for op in plan.curvature_ops() if op.kind in CYCLE_KINDS) == Counter(
        op for ops in tasks.cycle for op in ops
    )
    check_weights(plan)
    check_timelines(plan, result.timelines, tasks)
    assert result.cycle_time == pytest.approx(sum(t.step_time for t in result.timelines))
    replay(plan_actions(Topology(schedule), plan, tied=True))
    if options.get("move_weights", True) is False or options.get("strategy") == "published":
        assert result.moved_weights == 0
    if (
        (name, refresh_steps) in MUST_MOVE
        and options.get("move_weights", True)
        and options.get("strategy") != "published"
    ):
        # the movable path acts: W ops deferred to the cool-down come forward into the bubbles
        assert result.moved_weights > 0 and moved_weights(plan) == [d.moved_weights for d in result.devices]


@pytest.mark.parametrize("name", SCHEDULES)
def test_after_step_plans_of_weight_schedules_are_valid(name):
    schedule = SCHEDULES[name]()
    plan = validate_plan(
        after_step_plan(schedule, profile_for(schedule.num_stages), rules_of(profile_for(schedule.num_stages)), 2)
    )
    check_weights(plan)
    assert moved_weights(plan) == [0] * schedule.num_ranks


@pytest.mark.parametrize("grad_reduce", [0.0, 0.5])
@pytest.mark.parametrize("name", ["zb-h1 4x8", "dualpipev 4x8", "1f1b+w-late 3x6", "chimera+w 4x4"])
def test_shampoo_plans_of_weight_schedules_are_valid(name, grad_reduce):
    schedule = SCHEDULES[name]()
    profile = profile_for(schedule.num_stages, method="shampoo", grad_reduce=grad_reduce)
    for options in (PackOptions(move_weights=False), PackOptions(), PackOptions(refresh_steps=1)):
        result = pack(schedule, profile, rules_of(profile), options)
        plan = validate_plan(result.plan)
        check_weights(plan)
        check_timelines(plan, result.timelines, build_tasks(schedule, profile, rules_of(profile)))
        replay(plan_actions(Topology(schedule), plan, tied=True))


@pytest.mark.parametrize("inverse, weight_time", [(0.4, 1.0), (1.0, 1.0), (0.4, 0.5), (2.0, 1.5)])
@pytest.mark.parametrize("name", SCHEDULES)
def test_moving_weights_is_never_predicted_slower(name, inverse, weight_time):
    schedule = SCHEDULES[name]()
    profile = profile_for(schedule.num_stages, inverse=inverse, weight_time=weight_time)
    fixed = pack(schedule, profile, rules_of(profile), PackOptions(move_weights=False))
    for point in fixed.frontier:
        k = point.refresh_steps
        moved = pack(schedule, profile, rules_of(profile), PackOptions(refresh_steps=k))
        pinned = pack(schedule, profile, rules_of(profile), PackOptions(refresh_steps=k, move_weights=False))
        assert moved.step_time <= pinned.step_time + 1e-9
        validate_plan(moved.plan)
    default = pack(schedule, profile, rules_of(profile))
    assert default.overhead <= max(fixed.overhead, default.options.max_overhead) + 1e-9


def two_stage_case() -> tuple[Schedule, Profile]:
    """1F1B on 2 stages, 2 micro-batches, W ops at the end of each rank (F = B = W = 1):

        rank 0 |F0 F1 .  B0 .  B1 W0 W1|        stage 0's curvature B of micro-batch 1 and its
        rank 1 |.  F0 B0 F1 B1 W0 W1 . |        inverse B can only follow B1, where W0 and W1 sit.

    Pulling W0 into the bubble after B0 frees a unit after W1 for them."""
    schedule = weights_at_the_end(get_schedule("1f1b", 2, 2))
    layer = LayerProfile("l0", curvature=(0.05, 0.05), refresh=(0.3, 0.5), precondition=0.01)
    stages = (StageProfile(1.0, 2.0, layers=(layer,), weight=1.0), StageProfile(1.0, 2.0, weight=1.0))
    return schedule, Profile(stages=stages, time_unit="ms")


def test_moving_a_weight_gradient_strictly_helps():
    schedule, profile = two_stage_case()
    fixed = pack(
        schedule, profile, rules_of(profile), PackOptions(refresh_steps=1, move_weights=False, percentile=None)
    )
    moved = pack(schedule, profile, rules_of(profile), PackOptions(refresh_steps=1, percentile=None))
    assert fixed.step_time == pytest.approx(8.56)  # curvature B and inverse B after the step's work
    assert moved.step_time == pytest.approx(7.61)  # W0 after B0, the rest fits before the step's end
    assert moved.step_time < fixed.step_time - 0.5
    assert "weight gradients" in moved.placement
    assert moved.moved_weights == 1 and [d.moved_weights for d in moved.devices] == [1, 0]
    rank0 = moved.plan.steps[0][0]
    assert rank0.index(weight(0, 0)) == rank0.index(Op(OpKind.BACKWARD, 0, 0)) + 1
    check_weights(validate_plan(moved.plan))
    assert moved.to_dict()["moved_weights"] == 1 and moved.to_dict()["devices"][0]["moved_weights"] == 1


def test_a_registered_schedule_moves_weights_into_the_bubbles_of_a_slow_stage():
    """ZBV on 2 ranks, 8 micro-batches, stage 0 (rank 0) twice as slow: rank 1 waits for it between
    its B ops, and the packer pulls W ops into those waits (the runtime runs such a plan in
    tests/runtime/test_zero_bubble_runs.py)."""
    schedule = get_schedule("zbv", 2, 8)
    profile = profile_for(4, inverse=1.0)
    profile = replace(
        profile, stages=(replace(profile.stages[0], forward=2.0, backward=4.0, weight=2.0),) + profile.stages[1:]
    )
    for k in (1, 3):
        moved = pack(schedule, profile, rules_of(profile), PackOptions(refresh_steps=k))
        fixed = pack(schedule, profile, rules_of(profile), PackOptions(refresh_steps=k, move_weights=False))
        assert moved.moved_weights > 0 and fixed.moved_weights == 0
        assert moved.step_time < fixed.step_time
        plan = validate_plan(moved.plan)
        check_weights(plan)
        check_timelines(plan, moved.timelines, build_tasks(schedule, profile, rules_of(profile)))
        replay(plan_actions(Topology(schedule), plan, tied=True))


def test_weight_schedules_move_no_weights_when_asked_not_to():
    schedule, profile = two_stage_case()
    result = pack(schedule, profile, rules_of(profile), PackOptions(refresh_steps=1, move_weights=False))
    assert result.moved_weights == 0 and result.to_dict()["move_weights"] is False


def test_precondition_and_gradient_methods_wait_for_the_weight_gradients():
    schedule = get_schedule("zb-h1", 4, 8)
    graph = TaskGraph(schedule, (), task_rules("kfac"))
    precondition = Op(OpKind.PRECONDITION, 2, None)
    assert set(graph.dependencies(precondition)) == {weight(2, mb) for mb in range(8)}
    curvature_b = Op(OpKind.CURVATURE, 2, 3, 0, "l2.0", part=1)
    assert Op(OpKind.BACKWARD, 2, 3) in TaskGraph(schedule, [curvature_b], task_rules("kfac")).dependencies(
        curvature_b
    ), "output gradients are captured at B"
    tasks = build_tasks(schedule, profile_for(4, method="shampoo"), rules_of(profile_for(4, method="shampoo")))
    inverse = next(op for op in tasks.cycle[1] if (op.kind, op.part) == (OpKind.REFRESH, 0))
    assert set(tasks.graph.dependencies(inverse)) == {weight(1, mb) for mb in range(8)}


def test_validate_plan_rejects_weights_out_of_place():
    schedule = weights_after_backwards(get_schedule("1f1b", 2, 4))
    ranks = [list(ops) for ops in schedule.ranks]
    early = list(ranks[0])
    early.remove(weight(0, 1))
    early.insert(early.index(Op(OpKind.BACKWARD, 0, 1)), weight(0, 1))
    with pytest.raises(ScheduleError):
        validate_plan(Plan(schedule, ((tuple(early), tuple(ranks[1])),)))
    late = [op for op in ranks[0] if op.kind is not OpKind.WEIGHT] + [op for op in ranks[0] if op.kind is OpKind.WEIGHT]
    with pytest.raises(ScheduleError, match="pending weight gradients"):
        validate_plan(Plan(schedule, ((tuple(late), tuple(ranks[1])),)))
    missing = [op for op in ranks[0] if op != weight(0, 3)]
    with pytest.raises(ScheduleError, match="weight gradients differ"):
        validate_plan(Plan(schedule, ((tuple(missing), tuple(ranks[1])),)))


def test_captures_cost_extra_only_from_the_weight_gradient_on():
    A, B = 3_000_000, 5_000_000
    schedule = weights_at_the_end(get_schedule("gpipe", 1, 2))
    layer = LayerProfile("l0", curvature=(0.05, 0.05), refresh=(0.1, 0.1), precondition=0.01, capture_bytes=(A, B))
    profile = Profile(stages=(StageProfile(1.0, 2.0, layers=(layer,)),), time_unit="ms")
    f0, f1, b0, b1, w0, w1 = schedule.ranks[0]
    ca = [Op(OpKind.CURVATURE, 0, mb, 0, "l0", part=0) for mb in range(2)]
    cb = [Op(OpKind.CURVATURE, 0, mb, 0, "l0", part=1) for mb in range(2)]
    rest = (
        Op(OpKind.REFRESH, 0, None, 0, "l0", part=0),
        Op(OpKind.REFRESH, 0, None, 0, "l0", part=1),
        Op(OpKind.PRECONDITION, 0, None),
    )
    before = Plan(schedule, (((f0, f1, b0, b1, *ca, *cb, w0, w1) + rest,),), "kfac", task_rules("kfac"))
    after = Plan(schedule, (((f0, f1, b0, b1, w0, w1, *ca, *cb) + rest,),), "kfac", task_rules("kfac"))
    validate_plan(before), validate_plan(after)
    assert capture_peaks(before, profile)[0].bytes == 0, "curvature before W reads what W holds anyway"
    assert capture_peaks(after, profile)[0].bytes == 2 * (A + B)
