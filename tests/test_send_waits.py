"""Each send is waited for soon after it is issued (`pipefisher.planning.comm.send_waits`), not at
the step's end, and every plan still replays under NCCL's in-order rule."""

import pytest

from pipefisher.core.ir import Op, OpKind, Schedule
from pipefisher.core.topology import Topology
from pipefisher.planning.comm.actions import (
    Action,
    ActionKind,
    CommPlan,
    GradientPath,
    Message,
    Reduction,
    SendDone,
)
from pipefisher.planning.comm.evaluation import evaluation_actions
from pipefisher.planning.comm.plan import plan_actions
from pipefisher.planning.comm.replay import replay
from pipefisher.planning.comm.send_waits import SendWait, send_waits
from pipefisher.planning.packing.pack import PackOptions, pack
from pipefisher.planning.plan import Plan
from pipefisher.schedules import SCHEDULES, get_schedule

from builders import layered_profile, rules_of
from sweeps import cases, micro_batches_for


def first_order(schedule):
    return Plan(schedule, (schedule.ranks,))


def sends_in_flight(actions: tuple[Action, ...]) -> int:
    """The most sends `actions` have in flight at once; asserts the placement's invariants: a send
    is waited for once, after it is issued; when a rank sends on a channel, no earlier send on
    that channel is in flight (rule (b)); waits left for the step's tail (after its last op) are
    for the last send on their channel."""
    in_flight: dict[Message, tuple] = {}
    last_on_channel: dict[tuple, Message] = {}
    most = 0
    last_run = max((i for i, a in enumerate(actions) if a.kind is ActionKind.RUN), default=-1)
    for position, action in enumerate(actions):
        if action.kind is ActionKind.SEND:
            assert action.group not in in_flight.values(), f"{action}: an earlier send on {action.group} in flight"
            in_flight[action.message] = action.group
            last_on_channel[action.group] = action.message
            most = max(most, len(in_flight))
        elif action.kind is ActionKind.WAIT and isinstance(action.target, SendDone):
            group = in_flight.pop(action.target.message)
            if position > last_run:
                assert last_on_channel[group] == action.target.message, f"{action}: waited at the tail"
    assert not in_flight, f"sends never waited for: {sorted(map(str, in_flight))}"
    return most


def most_in_flight(comm: CommPlan) -> int:
    return max(sends_in_flight(actions) for step in comm.steps for actions in step)


@pytest.mark.parametrize("name, stages, micro_batches", cases((2, (2, 4, 8)), (4, (4, 8, 16))))
def test_every_schedule_waits_for_its_sends_early_and_replays(name, stages, micro_batches):
    schedule = get_schedule(name, stages, micro_batches)
    for data_parallel in (1, 2):
        comm = replay(plan_actions(Topology(schedule, data_parallel), first_order(schedule), tied=True))
        # a rank sends on at most 4 channels per stage it holds: a bound whatever the micro-batches
        assert most_in_flight(comm) <= 2 * len(schedule.stages_of(0)) + 2


def test_one_f_one_b_has_one_send_in_flight_per_rank():
    """4 stages, 8 micro-batches: waiting at the step's end a middle rank would hold 14 sends."""
    schedule = get_schedule("1f1b", 4, 8)
    comm = replay(plan_actions(Topology(schedule), first_order(schedule)))
    assert [max(sends_in_flight(actions) for actions in step) for step in comm.steps] == [1]
    sends = [sum(a.kind is ActionKind.SEND for a in actions) for actions in comm.steps[0]]
    assert sends == [8, 16, 16, 8]


def test_gpipe_gradients_are_waited_for_before_the_next_is_sent():
    """GPipe's last stage hears nothing back from its peer after the forwards: rule (b) alone
    bounds its gradients in flight (the wait right after the next backward, before its send)."""
    schedule = get_schedule("gpipe", 2, 4)
    last = replay(plan_actions(Topology(schedule), first_order(schedule))).steps[0][1]
    backward = [str(a) for a in last if a.kind in (ActionKind.RUN, ActionKind.SEND, ActionKind.WAIT)][8:]
    assert backward == [
        *("1B0", "send:0B0"),
        *("1B1", "w:send:0B0", "send:0B1"),
        *("1B2", "w:send:0B1", "send:0B2"),
        *("1B3", "w:send:0B2", "send:0B3"),
        "w:send:0B3",
        "w:step",
    ]


def test_a_send_is_waited_for_once_the_peer_has_answered():
    """1F1B on 2 stages: rank 1's gradient of micro-batch m is waited for right after the
    activation of m + 1 arrives (rank 0 sent it after posting the gradient's receive), before the
    forward runs; rank 0's activations wait for the next forward (rule (b)) or the gradient back."""
    schedule = get_schedule("1f1b", 2, 4)
    waits = send_waits(schedule.ranks, schedule.placement, schedule.num_stages)
    # rank 1: F0 B0 F1 B1 F2 B2 F3 B3: each gradient once the next activation is in
    assert [waits[1][position] for position in (1, 3, 5, 7)] == [SendWait(2), SendWait(4), SendWait(6), None]
    # rank 0: F0 F1 B0 F2 B1 F3 B2 B3
    assert [waits[0][position] for position in (0, 1, 3, 5)] == [
        SendWait(1, after_run=True),
        SendWait(2),
        SendWait(4),
        SendWait(6),
    ]
    alone = send_waits(schedule.ranks, schedule.placement, schedule.num_stages, bounded=False)
    assert alone[0][0] == SendWait(2), "rule (a) alone: once the first gradient is back"


def kfac_plan(schedule, data_parallel):
    profile = layered_profile(schedule.num_stages, 2, spread=False, p2p=0.05, inverse=0.6, sync=0.1, names="layer{i}")
    return pack(schedule, profile, rules_of(profile), PackOptions(refresh_steps=2, data_parallel=data_parallel)).plan


@pytest.mark.parametrize("name", SCHEDULES)
def test_packed_kfac_with_replicas_and_tensor_parallel_processes_waits_early(name):
    schedule = get_schedule(name, 2, micro_batches_for(name, 2, at_least=4))
    plan = kfac_plan(schedule, 2)
    shared = frozenset((op.stage, op.layer, 0) for op in plan.curvature_ops() if op.layer)
    for topology in (Topology(schedule, 2), Topology(schedule, 2, tensor_parallel=2)):
        comm = replay(plan_actions(topology, plan, tied=True, shared=shared, recompute="blocks"))
        most_in_flight(comm)


@pytest.mark.parametrize("reduction", list(Reduction))
@pytest.mark.parametrize("name", ["1f1b", "chimera", "zbv"])
def test_every_gradient_path_waits_early(name, reduction):
    schedule = get_schedule(name, 4, micro_batches_for(name, 4, at_least=8))
    comm = plan_actions(Topology(schedule, 2), kfac_plan(schedule, 2), tied=True, path=GradientPath(reduction))
    most_in_flight(replay(comm))


@pytest.mark.parametrize("name", SCHEDULES)
def test_evaluation_passes_wait_for_each_send_before_the_next(name):
    """Forward-only: no rank hears back from its peer, rule (b) bounds the sends."""
    schedule = get_schedule(name, 4, micro_batches_for(name, 4, at_least=8))
    comm = evaluation_actions(Topology(schedule, 2), 3 * schedule.num_micro_batches)
    assert most_in_flight(comm) <= len(schedule.stages_of(0))


def test_a_plan_the_bounded_waits_would_hang_falls_back_to_waiting_once_heard_back():
    """Rank 0 holds stages 0 and 2, rank 1 stages 1 and 3; rank 1 runs 3F0 before 1F1, so it posts
    1F1's receive only once 3F0's input is in, which rank 0 sends after 0F2: waiting for 1F1's
    send before sending 1F2 (rule (b)) would hang. The plan keeps rule (a) alone and replays."""
    forward = lambda stage, m: Op(OpKind.FORWARD, stage, m)
    ranks = (
        tuple(forward(stage, m) for stage in (0, 2) for m in range(3)),
        tuple(forward(stage, m) for m in range(3) for stage in (1, 3)),
    )
    placement = {(0, 0): 0, (0, 1): 1, (0, 2): 0, (0, 3): 1}
    schedule = Schedule("crossed", 4, 3, placement, ranks)
    rank0 = [str(a) for a in replay(plan_actions(Topology(schedule), first_order(schedule))).steps[0][0]]
    assert rank0.index("w:send:1F1") > rank0.index("send:1F2")
    assert rank0.index("w:send:1F0") == rank0.index("2F0") - 1, "once 2F0's input from rank 1 is in"
