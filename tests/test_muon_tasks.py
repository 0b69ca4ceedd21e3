"""Muon's tasks on the planner's one task model: no refresh work, one P op per stage copy and step
right after the stage's gradient is final; packed and after-step plans validate, simulate and
replay under NCCL's rule, and a replicated stage's shares are broadcast (``pgrad``) after its
reduction instead."""

import pytest

from pipefisher.core.ir import GRADIENT_KINDS, Op, OpKind
from pipefisher.core.topology import Topology
from pipefisher.planning.comm.actions import ActionKind, CollectiveKind, GradientPath
from pipefisher.planning.comm.plan import plan_actions
from pipefisher.planning.comm.replay import replay
from pipefisher.planning.packing.pack import PackOptions, after_step_plan, pack
from pipefisher.planning.plan import simulate_plan, validate_plan
from pipefisher.planning.simulate import simulate
from pipefisher.planning.tasks import build_tasks
from pipefisher.schedules import SCHEDULES, get_schedule

from builders import layered_profile, rules_of
from sweeps import micro_batches_for


def muon_profile(num_stages: int, orthogonalise: float = 0.3):
    """Two matrices per stage, each orthogonalised in `orthogonalise` ms; nothing else timed."""
    return layered_profile(
        num_stages,
        2,
        spread=False,
        p2p=0.05,
        grad_reduce=0.2,
        curvature=0.0,
        inverse=0.0,
        precondition=orthogonalise,
        names="w{i}",
        method="muon",
    )


def schedule_of(name: str, stages: int = 4):
    return get_schedule(name, stages, micro_batches_for(name, stages, at_least=8))


def test_muon_has_no_cycle_work_and_a_p_op_after_each_stage_copys_gradient():
    schedule = schedule_of("1f1b")
    tasks = build_tasks(
        schedule, muon_profile(schedule.num_stages), rules_of(muon_profile(schedule.num_stages)), data_parallel=1
    )
    assert not any(tasks.cycle)
    assert [list(ops) for ops in tasks.per_step] == [[Op(OpKind.PRECONDITION, stage, None, 0)] for stage in range(4)]
    precondition = tasks.per_step[2][0]
    assert set(tasks.graph.dependencies(precondition)) == {Op(OpKind.BACKWARD, 2, mb) for mb in range(8)}


@pytest.mark.parametrize("name", SCHEDULES)
def test_unreplicated_plans_validate_simulate_and_replay_and_run_every_p_op_once_a_step(name):
    schedule = schedule_of(name)
    profile = muon_profile(schedule.num_stages)
    for plan in (
        pack(schedule, profile, rules_of(profile), PackOptions()).plan,
        after_step_plan(schedule, profile, rules_of(profile), 2),
    ):
        assert plan.method == "muon"
        validate_plan(plan)
        simulate_plan(plan, profile)
        for step in plan.steps:
            preconditions = [op for ops in step for op in ops if op.kind is OpKind.PRECONDITION]
            assert sorted(preconditions) == sorted(
                Op(OpKind.PRECONDITION, stage, None, pipe) for pipe, stage in schedule.placement
            )
            for ops in step:  # after the last op that makes its stage's gradient
                for position, op in enumerate(ops):
                    if op.kind is OpKind.PRECONDITION:
                        later = [
                            o
                            for o in ops[position:]
                            if o.kind in GRADIENT_KINDS - {OpKind.PRECONDITION} and o.stage == op.stage
                        ]
                        assert not later, (op, later)
        replay(plan_actions(Topology(schedule, 1), plan, tied=True))


def test_on_1f1b_the_p_ops_of_the_later_stages_hide_in_the_drain_bubble():
    """Stage s ends its backwards s steps of a backward before stage 0: with orthogonalisation
    shorter than that, every stage but the first orthogonalises inside the drain."""
    schedule = schedule_of("1f1b")
    profile = muon_profile(schedule.num_stages, orthogonalise=0.5)
    first_order = simulate(schedule, profile).step_time
    result = pack(schedule, profile, rules_of(profile), PackOptions())
    timeline = simulate_plan(result.plan, profile)[0]
    assert timeline.step_time == pytest.approx(first_order + 2 * 0.5), "only stage 0's two matrices lengthen the step"
    assert [device.precondition_time for device in result.devices] == [1.0] * 4


@pytest.mark.parametrize("name", ["1f1b", "chimera"])
def test_replicated_stages_share_their_matrices_after_the_reduction(name):
    """No P op (`precondition` False, as the run packs with one gradient worker per matrix):
    every replica waits for its stage's reduction, then launches and waits for the broadcast of
    the shares, all before the step's world reduction, and the order replays under NCCL's rule."""
    schedule = schedule_of(name)
    data_parallel = 2 if name == "1f1b" else 1
    profile = muon_profile(schedule.num_stages)
    plan = pack(schedule, profile, rules_of(profile), PackOptions(data_parallel=data_parallel, precondition=False)).plan
    assert not any(op.kind is OpKind.PRECONDITION for step in plan.steps for ops in step for op in ops)
    topology = Topology(schedule, data_parallel)
    comm = replay(plan_actions(topology, plan, tied=True, path=GradientPath(workers_per_layer=1)))
    for rank, actions in enumerate(comm.steps[0]):
        order = [
            (a.kind, a.target.kind, a.target.key[:1])
            for a in actions
            if a.kind in (ActionKind.LAUNCH, ActionKind.WAIT) and hasattr(a.target, "kind")
        ]
        stages = sorted({stage for _, stage in topology.stages_of(rank)})
        for stage in stages:
            reduced = order.index((ActionKind.WAIT, CollectiveKind.GRAD, (stage,)))
            shared = order.index((ActionKind.LAUNCH, CollectiveKind.PGRAD, (stage,)))
            assert (
                reduced
                < shared
                < order.index((ActionKind.WAIT, CollectiveKind.PGRAD, (stage,)))
                < order.index((ActionKind.LAUNCH, CollectiveKind.STEP, ()))
            )
        assert sum(kind is CollectiveKind.PGRAD for _, kind, _ in order) == 2 * len(stages)
