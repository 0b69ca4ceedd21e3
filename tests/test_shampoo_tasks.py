"""Shampoo's tasks on the planner's one task model: which ops exist, what they wait for, and that
packed and after-step plans validate, simulate and replay under NCCL's rule."""

import dataclasses

import pytest

from pipefisher.core.ir import Op, OpKind, ScheduleError
from pipefisher.core.profile import ProfileError, profile_from_dict
from pipefisher.core.topology import Topology
from pipefisher.methods.registry import method_of_profile, task_rules
from pipefisher.planning.comm.actions import ActionKind, CommOrderError
from pipefisher.planning.comm.plan import plan_actions
from pipefisher.planning.comm.replay import replay
from pipefisher.planning.packing.pack import PackOptions, after_step_plan, pack
from pipefisher.planning.plan import Plan, simulate_plan, validate_plan
from pipefisher.planning.tasks import build_tasks
from pipefisher.schedules import SCHEDULES, get_schedule

from builders import layered_profile, rules_of
from sweeps import micro_batches_for


def shampoo_profile(num_stages, layers=2, root=0.6, sync=0.1):
    """Shampoo layers: roots of L (part 0) and R (part 1), the gradient's sync (part 0's)."""
    return layered_profile(
        num_stages,
        layers,
        spread=False,
        p2p=0.05,
        curvature=0.0,
        inverse=root,
        inverse_b=root / 2,
        precondition=0.0,
        sync=sync,
        sync_b=0.0,
        names="w{i}",
        method="shampoo",
    )


def schedule_of(name, stages=4, micro_batches=8):
    """Schedule `name` with its own chunks per rank, on the fewest micro-batches from
    `micro_batches` on that it takes."""
    return get_schedule(name, stages, micro_batches_for(name, stages, at_least=micro_batches))


def test_shampoo_has_no_curvature_and_one_sync_per_layer():
    schedule = schedule_of("chimera")
    tasks = build_tasks(
        schedule,
        shampoo_profile(schedule.num_stages),
        rules_of(shampoo_profile(schedule.num_stages)),
        data_parallel=2,
        precondition=False,  # a replicated stage's, as `ShampooConfig.precondition_op` says
    )
    kinds = {op.kind for ops in tasks.cycle for op in ops}
    assert {(op.kind, op.part) for ops in tasks.cycle for op in ops} == {
        (OpKind.SYNC, 0),
        (OpKind.REFRESH, 0),
        (OpKind.REFRESH, 1),
        (OpKind.EXCHANGE, None),
    }
    assert kinds == {OpKind.SYNC, OpKind.REFRESH, OpKind.EXCHANGE}
    assert not any(tasks.per_step), "a replicated stage preconditions in the optimizer step, not in the op lists"
    syncs = [op for ops in tasks.cycle for op in ops if (op.kind, op.part) == (OpKind.SYNC, 0)]
    assert len(syncs) == schedule.num_stages * 2 * 2, "one gradient sync per layer and pipe of every stage"


def test_refresh_work_waits_for_the_whole_gradient_of_the_first_step_only():
    schedule = schedule_of("1f1b")
    tasks = build_tasks(schedule, shampoo_profile(schedule.num_stages), rules_of(shampoo_profile(schedule.num_stages)))
    graph = tasks.graph
    root = Op(OpKind.REFRESH, 2, None, 0, "w1", part=1)
    backwards = {Op(OpKind.BACKWARD, 2, mb) for mb in range(8)}
    assert set(graph.dependencies(root, first_step=True)) == backwards
    assert graph.dependencies(root, first_step=False) == (), "later steps read the gradient captured in the first"
    assert set(graph.first_step_inputs(root)) == backwards


def test_replicated_refresh_work_of_both_factors_waits_for_the_gradient_sync_of_every_replica():
    schedule = schedule_of("chimera")
    graph = build_tasks(
        schedule, shampoo_profile(schedule.num_stages), rules_of(shampoo_profile(schedule.num_stages))
    ).graph
    for part in (0, 1):
        deps = graph.dependencies(Op(OpKind.REFRESH, 1, None, 0, "w0", part))
        assert set(deps) == {Op(OpKind.SYNC, 1, None, pipe, "w0", part=0) for pipe in (0, 1)}
    sync = Op(OpKind.SYNC, 1, None, 1, "w0", part=0)
    assert {dep.kind for dep in graph.dependencies(sync)} == {OpKind.BACKWARD}


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("data_parallel", [1, 2])
def test_shampoo_plans_validate_simulate_and_replay_under_nccl_order(name, data_parallel):
    schedule = schedule_of(name)
    profile = shampoo_profile(schedule.num_stages)
    packed = pack(schedule, profile, rules_of(profile), PackOptions(refresh_steps=3, data_parallel=data_parallel)).plan
    after = after_step_plan(schedule, profile, rules_of(profile), 3, data_parallel=data_parallel)
    for plan in (packed, after):
        assert plan.method == "shampoo"
        validate_plan(plan)
        assert len(simulate_plan(plan, profile)) == 3
        comm = replay(plan_actions(Topology(schedule, data_parallel), plan, tied=True))
        kinds = {
            a.target.kind for step in comm.steps for actions in step for a in actions if a.kind is ActionKind.LAUNCH
        }
        assert ("sync" in kinds) == (data_parallel > 1 or name == "chimera")
        assert ("exchange" in kinds) == (name == "chimera")


def test_packed_shampoo_roots_go_into_bubbles_and_syncs_launch_after_the_last_backward():
    schedule = schedule_of("gpipe")
    profile = shampoo_profile(schedule.num_stages, layers=3, root=0.5)
    result = pack(schedule, profile, rules_of(profile), PackOptions(percentile=None))
    assert result.refresh_steps >= 1 and result.overhead < 0.05
    step0 = result.plan.steps[0]
    for rank, ops in enumerate(step0):
        last_backward = max(i for i, op in enumerate(ops) if op.kind is OpKind.BACKWARD)
        refresh = [i for i, op in enumerate(ops) if op.kind is OpKind.REFRESH]
        assert all(i > last_backward for i in refresh), f"rank {rank}: a root before its gradient is whole"
    chimera = schedule_of("chimera")
    plan = pack(
        chimera,
        shampoo_profile(chimera.num_stages),
        rules_of(shampoo_profile(chimera.num_stages)),
        PackOptions(refresh_steps=2),
    ).plan
    for ops in plan.steps[0]:
        for position, op in enumerate(ops):
            if (op.kind, op.part) == (OpKind.SYNC, 0):
                own = [
                    i
                    for i, o in enumerate(ops)
                    if o.kind is OpKind.BACKWARD and (o.pipe, o.stage) == (op.pipe, op.stage)
                ]
                assert position > max(own)


def test_a_plan_keeps_its_method_through_json_and_refuses_foreign_op_kinds(tmp_path):
    schedule = schedule_of("1f1b")
    plan = after_step_plan(
        schedule, shampoo_profile(schedule.num_stages), rules_of(shampoo_profile(schedule.num_stages)), 2
    )
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json", task_rules) == plan
    assert Plan.load(tmp_path / "plan.json").rules is None, "the caller gives the rules"
    kfac_plan = after_step_plan(
        schedule,
        dataclasses.replace(shampoo_profile(schedule.num_stages), method="kfac"),
        rules_of(dataclasses.replace(shampoo_profile(schedule.num_stages), method="kfac")),
        2,
    )
    with pytest.raises(ScheduleError, match="method shampoo has no CURVATURE of part 0"):
        validate_plan(dataclasses.replace(kfac_plan, method="shampoo", rules=task_rules("shampoo")))
    steps = list(plan.steps)
    steps[0] = tuple(ops + (Op(OpKind.FOLD, 0),) if rank == 0 else ops for rank, ops in enumerate(steps[0]))
    with pytest.raises(ScheduleError, match="method shampoo has no FOLD"):
        validate_plan(dataclasses.replace(plan, steps=tuple(steps)))
    with pytest.raises(ScheduleError, match="not a curvature method"):
        task_rules("adam")


def test_shampoo_syncs_launched_in_different_orders_are_caught_before_anything_runs():
    schedule = schedule_of("chimera")
    plan = after_step_plan(
        schedule, shampoo_profile(schedule.num_stages), rules_of(shampoo_profile(schedule.num_stages)), 2
    )
    steps = [list(map(list, step)) for step in plan.steps]
    ops = steps[0][0]
    syncs = [i for i, op in enumerate(ops) if (op.kind, op.part) == (OpKind.SYNC, 0)]
    ops[syncs[0]], ops[syncs[1]] = ops[syncs[1]], ops[syncs[0]]
    swapped = dataclasses.replace(plan, steps=tuple(tuple(map(tuple, step)) for step in steps))
    with pytest.raises((ScheduleError, CommOrderError)):
        validate_plan(swapped)
        replay(plan_actions(Topology(schedule), swapped))


def test_profile_method_round_trips_and_unknown_methods_are_refused():
    profile = shampoo_profile(2)
    assert profile_from_dict(profile.to_dict()) == profile
    assert dataclasses.replace(profile, method="kfac").to_dict()["method"] == "kfac", "v2 files name their method"
    with pytest.raises(ProfileError, match="method: 'no such'"):
        profile_from_dict({**profile.to_dict(), "method": "no such"})
    with pytest.raises(ScheduleError, match="'adam' is not a curvature method"):
        method_of_profile(profile_from_dict({**profile.to_dict(), "method": "adam"}))


def test_rules_differ_only_in_where_inputs_come_from():
    kfac, shampoo = task_rules("kfac"), task_rules("shampoo")
    assert kfac.curvature and kfac.precondition and kfac.syncs == (0, 1)
    assert not shampoo.curvature and shampoo.precondition, "a P op where helpers ask for one"
    assert shampoo.sync_for(1) == 0, "both statistics read the one gradient sync"
