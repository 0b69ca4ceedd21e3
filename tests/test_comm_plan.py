"""Issue order of every rank's communication, and its replay under NCCL's in-order rule."""

import pytest

from pipefisher.core.ir import Op, OpKind
from pipefisher.core.topology import Topology
from pipefisher.planning.comm.actions import (
    STEP,
    Action,
    ActionKind,
    CommOrderError,
    CommPlan,
    Message,
    input_message,
    output_message,
    sync_collective,
)
from pipefisher.planning.comm.plan import plan_actions
from pipefisher.planning.comm.processes import process_programs
from pipefisher.planning.comm.replay import replay, replay_programs
from pipefisher.planning.packing.pack import PackOptions, after_step_plan, pack
from pipefisher.planning.plan import Plan
from pipefisher.schedules import SCHEDULES, get_schedule

from builders import layered_profile, rules_of
from sweeps import cases, micro_batches_for


def first_order(schedule):
    return Plan(schedule, (schedule.ranks,))


def kfac_profile(num_stages, layers=2):
    """Every stage alike: F 1, B 2, p2p 0.05; `layers` K-FAC layers with inverses 0.6, syncs 0.1."""
    return layered_profile(num_stages, layers, spread=False, p2p=0.05, inverse=0.6, sync=0.1, names="layer{i}")


@pytest.mark.parametrize("name, stages, micro_batches", cases(*((d, (d, 2 * d, 4 * d)) for d in (2, 3, 4, 8))))
def test_every_first_order_schedule_replays(name, stages, micro_batches):
    schedule = get_schedule(name, stages, micro_batches)
    for data_parallel in (1, 2):
        for tied in (False, True):
            replay(plan_actions(Topology(schedule, data_parallel), first_order(schedule), tied))


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("placement", ["packed", "after-step"])
@pytest.mark.parametrize("data_parallel", [1, 2])
def test_kfac_plans_replay(name, placement, data_parallel):
    schedule = get_schedule(name, 4, micro_batches_for(name, 4, at_least=8))
    profile = kfac_profile(schedule.num_stages)
    result = pack(schedule, profile, rules_of(profile), PackOptions(refresh_steps=3, data_parallel=data_parallel))
    plan = (
        result.plan
        if placement == "packed"
        else after_step_plan(schedule, profile, rules_of(profile), 3, data_parallel=data_parallel)
    )
    comm = replay(plan_actions(Topology(schedule, data_parallel), plan, tied=True))
    launched = {a.target for step in comm.steps for actions in step for a in actions if a.kind is ActionKind.LAUNCH}
    kinds = {collective.kind for collective in launched}
    assert {"step", "tied"} <= kinds
    replicated = data_parallel > 1 or schedule.num_pipes > 1  # Chimera's two pipes hold every stage twice
    assert ("sync" in kinds) == replicated, "factors are synced over every replica"
    assert ("exchange" in kinds) == (schedule.num_pipes > 1), "inverses are exchanged between pipes"
    assert ("grad" in kinds) == replicated


def test_channels_carry_one_direction_in_micro_batch_order_and_one_receive_is_posted_ahead():
    schedule = get_schedule("1f1b", 4, 8)
    comm = plan_actions(Topology(schedule), first_order(schedule))
    for rank, actions in enumerate(comm.steps[0]):
        for kind in (ActionKind.POST, ActionKind.SEND):
            for direction in ("fwd", "bwd"):
                messages = [a.target.consumer for a in actions if a.kind is kind and a.group[0] == direction]
                assert [m.micro_batch for m in messages] == sorted(m.micro_batch for m in messages)
        pending = 0
        for action in actions:
            if action.kind is ActionKind.POST:
                pending += 1
                assert pending <= 2, "at most the current input and the next one are posted"
            elif action.kind is ActionKind.WAIT and isinstance(action.target, Message):
                pending -= 1
        assert pending == 0


def todays_issue_order(schedule):
    """The executor before the NCCL rework: one group per stage boundary for both directions; the
    receive of op i + 1 is posted before op i runs; op i's output is sent right after it."""
    programs = []
    for ops in schedule.ranks:
        actions = []

        def post(op):
            message = input_message(op, schedule.num_stages)
            if message is not None:
                peer = schedule.placement[(message.producer.pipe, message.producer.stage)]
                actions.append(Action(ActionKind.POST, message, ("p2p", message.lower_stage), peer))

        for index, op in enumerate(ops):
            if index == 0:
                post(op)
            if index + 1 < len(ops):
                post(ops[index + 1])
            if input_message(op, schedule.num_stages) is not None:
                actions.append(Action(ActionKind.WAIT, input_message(op, schedule.num_stages)))
            actions.append(Action(ActionKind.RUN, op))
            produced = output_message(op, schedule.num_stages)
            if produced is not None:
                peer = schedule.placement[(produced.consumer.pipe, produced.consumer.stage)]
                actions.append(Action(ActionKind.SEND, produced, ("p2p", produced.lower_stage), peer))
        programs.append(tuple(actions))
    members = {("p2p", stage): (stage, stage + 1) for stage in range(schedule.num_stages - 1)}
    return CommPlan(Topology(schedule), (tuple(programs),), members)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_todays_issue_order_is_rejected_with_the_stuck_ops_marked(name):
    schedule = get_schedule(name, 2, 4)
    with pytest.raises(CommOrderError) as info:
        replay(todays_issue_order(schedule), name=f"{name} (shared channels)")
    text = str(info.value)
    first, *grid = text.splitlines()
    assert first.startswith(f"{name} (shared channels): deadlock under NCCL's in-order rule")
    assert len(grid) == 2 and grid[0].startswith("rank  0:") and grid[1].startswith("rank  1:")
    assert all(">" in row and "<" in row for row in grid), "each rank's stuck action is marked"
    assert "queued on rank" in first


def test_the_1f1b_example_of_the_issue_deadlocks_where_it_says():
    """rank 0: send a0 | recv g0 | send a1; rank 1: recv a0 | recv a1 | send g0."""
    text = str(pytest.raises(CommOrderError, replay, todays_issue_order(get_schedule("1f1b", 2, 4))).value)
    assert "rank 0 waits for 0B0, queued on rank 1 behind its recv:1F1" in text
    assert "rank 1 waits for 1F1, queued on rank 0 behind its recv:0B0" in text


def test_receives_posted_out_of_order_are_a_mismatch():
    schedule = get_schedule("gpipe", 2, 2)
    comm = plan_actions(Topology(schedule), first_order(schedule))
    receiver = list(comm.steps[0][1])
    posts = [i for i, a in enumerate(receiver) if a.kind is ActionKind.POST]
    receiver[posts[0]], receiver[posts[1]] = receiver[posts[1]], receiver[posts[0]]
    swapped = CommPlan(comm.topology, ((comm.steps[0][0], tuple(receiver)),), comm.members)
    with pytest.raises(CommOrderError, match=r"mismatch on fwd/0/0/0: rank 0 has 1F0; rank 1 has 1F1"):
        replay(swapped)


def test_collectives_launched_in_different_orders_deadlock():
    schedule = get_schedule("1f1b", 2, 2)
    topology = Topology(schedule, data_parallel=2)
    comm = plan_actions(topology, first_order(schedule))
    a, b = sync_collective(0, "x", 0), sync_collective(0, "x", 1)

    def with_syncs(actions, first, second):
        launches = [Action(ActionKind.LAUNCH, first), Action(ActionKind.LAUNCH, second)]
        waits = [Action(ActionKind.WAIT, first), Action(ActionKind.WAIT, second)]
        return tuple(launches + waits) + actions

    steps = list(comm.steps[0])
    steps[0] = with_syncs(steps[0], a, b)  # ranks 0 and 2 hold stage 0
    steps[2] = with_syncs(steps[2], b, a)
    with pytest.raises(CommOrderError, match="mismatch on curv/0"):
        replay(CommPlan(topology, (tuple(steps),), comm.members))


def test_an_operation_nobody_matches_is_reported():
    schedule = get_schedule("gpipe", 2, 2)
    comm = plan_actions(Topology(schedule), first_order(schedule))
    extra = Action(ActionKind.POST, Message(Op(OpKind.FORWARD, 1, 5)), ("fwd", 0, 0, 0), 0)
    ranks = (comm.steps[0][0], comm.steps[0][1] + (extra,))
    with pytest.raises(CommOrderError, match="rank 1 issues 1F5 on fwd/0/0/0, which never completes"):
        replay(CommPlan(comm.topology, (ranks,), comm.members))


def test_every_step_ends_with_one_world_reduction_after_the_gradient_reductions():
    schedule = get_schedule("chimera", 2, 4)
    comm = plan_actions(Topology(schedule), first_order(schedule), tied=True)
    for actions in comm.steps[0]:
        assert actions[-2:] == (Action(ActionKind.LAUNCH, STEP), Action(ActionKind.WAIT, STEP))
        launches = [i for i, a in enumerate(actions) if a.kind is ActionKind.LAUNCH and a.target.kind == "grad"]
        last_backward = {}
        for i, a in enumerate(actions):
            if a.kind is ActionKind.RUN and a.target.kind is OpKind.BACKWARD:
                last_backward[a.target.stage] = i
        assert sorted(actions[i].target.key[0] for i in launches) == sorted(last_backward)
        for i in launches:
            assert i == last_backward[actions[i].target.key[0]] + 1 + (actions[i - 1].kind is ActionKind.SEND), (
                "a stage's reduction starts right after its last backward (and its send)"
            )


def test_outstanding_collectives_at_a_step_boundary():
    """Syncs launched in different steps by the two replicas: at the boundary in between, the
    one rank's launch is incomplete; once both launched, it is complete."""
    schedule = get_schedule("1f1b", 2, 2)
    topology = Topology(schedule, data_parallel=2)
    sync = sync_collective(0, "x", 0)
    early = (Action(ActionKind.LAUNCH, sync),)
    late_wait = (Action(ActionKind.WAIT, sync),)
    steps = []
    base = plan_actions(topology, Plan(schedule, (schedule.ranks,) * 3))
    for index, step in enumerate(base.steps):
        ranks = list(step)
        if index == 0:
            ranks[0] = early + ranks[0]
        if index == 1:
            ranks[2] = early + ranks[2]
        if index == 2:
            ranks[0] = late_wait + ranks[0]
            ranks[2] = late_wait + ranks[2]
        steps.append(tuple(ranks))
    comm = replay(CommPlan(topology, tuple(steps), base.members))
    assert comm.outstanding(1, 0) == ([], [sync])
    assert comm.outstanding(2, 0) == ([sync], [])
    assert comm.outstanding(2, 2) == ([sync], [])
    assert comm.outstanding(1, 2) == ([], [])


@pytest.mark.parametrize("stages, micro_batches", [(2, 4), (4, 4), (4, 8)])
def test_packed_chimera_plans_replay_over_a_sweep_of_task_times(stages, micro_batches):
    """Exchanges and inverses wait for syncs other replicas launch; whatever steps the packer puts
    them in, no rank may wait for a sync its peer launches only later."""
    from dataclasses import replace

    schedule = get_schedule("chimera", stages, micro_batches)
    base = kfac_profile(schedule.num_stages, layers=3)
    for curvature in (0.01, 0.05, 0.3):
        for inverse in (0.05, 0.3, 1.0, 3.0):
            for sync in (0.01, 0.5):
                layers = tuple(
                    replace(
                        layer,
                        curvature=(curvature, curvature),
                        refresh=(inverse, inverse),
                        sync=(sync, sync),
                    )
                    for layer in base.stages[0].layers
                )
                profile = replace(base, stages=tuple(replace(stage, layers=layers) for stage in base.stages))
                for k in (None, 2, 3):
                    plan = pack(schedule, profile, rules_of(profile), PackOptions(refresh_steps=k)).plan
                    replay(
                        plan_actions(Topology(schedule), plan, tied=True), name=f"c{curvature} i{inverse} s{sync} k{k}"
                    )


@pytest.mark.parametrize("name", SCHEDULES)
def test_tensor_parallel_plans_replay_with_their_all_reduces(name):
    """Two tensor-parallel processes per rank, two replicas, K-FAC packed, every A factor built in
    shares: every process runs its rank's actions on its shard's communicators, each forward and
    input-gradient backward, and each op that first reads an A factor (its inversion, or the
    exchange of a replica that does not invert it), followed by an all-reduce over its rank's
    processes; the step's world reduction spans all."""
    schedule = get_schedule(name, 2, micro_batches_for(name, 2, at_least=4))
    profile = kfac_profile(schedule.num_stages)
    plan = pack(schedule, profile, rules_of(profile), PackOptions(refresh_steps=2, data_parallel=2)).plan
    topology = Topology(schedule, data_parallel=2, tensor_parallel=2)
    shared = frozenset((op.stage, op.layer, 0) for op in plan.curvature_ops() if op.layer)
    comm = replay(plan_actions(topology, plan, tied=True, shared=shared))
    assert {op for op in comm.tensor_ops if op.kind is OpKind.REFRESH} == {
        op for op in plan.curvature_ops() if (op.kind, op.part) == (OpKind.REFRESH, 0)
    }
    programs, members = process_programs(comm)
    assert len(programs) == topology.processes == 2 * topology.world_size
    assert members[("world",)] == tuple(range(topology.processes))
    for process, program in enumerate(programs):
        rank, shard = topology.rank_of_process(process)
        ops = [
            a.target
            for a in program
            if a.kind is ActionKind.RUN
            and (a.target.kind in (OpKind.FORWARD, OpKind.BACKWARD) or a.target in comm.tensor_ops)
        ]
        reduces = [a.target for a in program if a.kind is ActionKind.LAUNCH and a.target.kind.value == "tensor"]
        assert [c.key for c in reduces] == [(str(op),) for op in ops]
        assert all(set(members[c.group]) == {2 * rank, 2 * rank + 1} for c in reduces)
        for action in program:
            if action.kind in (ActionKind.POST, ActionKind.SEND):
                assert action.peer % 2 == shard and process in members[action.group], (
                    "a shard talks to the same shard of its peers"
                )


@pytest.mark.parametrize("recompute", ["blocks", "selective"])
def test_recomputed_blocks_all_reduce_again_inside_each_backward(recompute):
    """`model.recompute blocks` with two tensor-parallel processes per rank: every backward
    all-reduces its blocks' recomputed forwards before its own, on both shards, and the plan
    replays; `selective` (attention cores, no split layer) all-reduces as without recomputation."""
    schedule = get_schedule("1f1b", 2, 4)
    topology = Topology(schedule, tensor_parallel=2)
    comm = replay(plan_actions(topology, first_order(schedule), recompute=recompute))
    programs, _ = process_programs(comm)
    for program in programs:
        ops = [a.target for a in program if a.kind is ActionKind.RUN]
        reduces = [a.target.key for a in program if a.kind is ActionKind.LAUNCH and a.target.kind.value == "tensor"]
        recomputed = [(str(op), "recomputed") for op in ops if op.kind is OpKind.BACKWARD]
        assert len(reduces) == len(ops) + (len(recomputed) if recompute == "blocks" else 0)
        assert (set(recomputed) <= set(reduces)) is (recompute == "blocks")
        for op in ops:
            if recompute == "blocks" and op.kind is OpKind.BACKWARD:
                assert reduces.index((str(op), "recomputed")) + 1 == reduces.index((str(op),)), op


def test_a_shard_that_does_not_recompute_is_caught():
    """Process 1 (shard 1 of rank 0) runs without recomputation while the others recompute blocks:
    its first backward's all-reduce meets shard 0's recomputed forward's."""
    schedule = get_schedule("1f1b", 2, 4)
    topology = Topology(schedule, tensor_parallel=2)
    programs, members = process_programs(plan_actions(topology, first_order(schedule), recompute="blocks"))
    plain, _ = process_programs(plan_actions(topology, first_order(schedule)))
    programs[1] = plain[1]
    with pytest.raises(
        CommOrderError, match=r"mismatch on tensor/0: rank 0 has tensor:0B0:recomputed; rank 1 has tensor:0B0"
    ):
        replay_programs(programs, members)


def test_tensor_parallel_processes_that_reduce_in_different_orders_are_caught():
    schedule = get_schedule("1f1b", 2, 4)
    topology = Topology(schedule, tensor_parallel=2)
    programs, members = process_programs(plan_actions(topology, first_order(schedule)))
    shard_one = list(programs[1])
    launches = [i for i, a in enumerate(shard_one) if a.kind is ActionKind.LAUNCH and a.target.kind.value == "tensor"]
    for first, second in (
        (launches[0], launches[1]),
        (launches[0] + 1, launches[1] + 1),
    ):  # the launches and their waits
        shard_one[first], shard_one[second] = shard_one[second], shard_one[first]
    programs[1] = tuple(shard_one)
    with pytest.raises(CommOrderError, match=r"mismatch on tensor/0: rank 0 has tensor:0F0; rank 1 has tensor:0F1"):
        replay_programs(programs, members)
