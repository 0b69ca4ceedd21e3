"""Tensor parallelism in the issue order: the communicators and actions of every process.

A rank of a tensor-parallel run is T processes, one per shard of its blocks
(`pipefisher.core.topology`). They perform the rank's actions (`pipefisher.planning.comm.plan`),
each on its own copy of every communicator: shard s of every rank talks to shard s of the others,
so the T copies of the pipeline never share a queue. Two communicators are not copied: the
end-of-step reduction (``("world",)``) spans every process, so that all of them agree on the
step's loss, norm, overflow and stop signal; and each rank has a ``("tensor", rank)``
communicator of its T processes, on which every forward and every backward of an input gradient
sums its blocks' partial results (`TENSOR_KINDS`): blocking all-reduces, issued and completed
inside the op. With recomputation (`model.recompute: blocks`) a backward first runs its blocks'
forward again, row-split all-reduces included (up to the last tensor the backward needs), block
by block before each block's backward: more blocking all-reduces inside the same op, issued in
the same order by every shard (they run the same ops on the same autograd graph), which the
programs write as a collective of the recomputed forwards before the backward's
(`tensor_collectives`); `selective` recomputes attention cores, which hold no split layer.
`process_programs` writes those into the programs the replay checks, so the
pipeline's point-to-point, the data-parallel and curvature collectives and the tensor-parallel
all-reduces are checked together under NCCL's rule. So is the sum of a statistic the processes
build in shares, inside the curvature op that first reads it (`CommPlan.tensor_ops`). Pure Python:
no torch.
"""

from __future__ import annotations

from pipefisher.core.ir import Op, OpKind
from pipefisher.core.topology import Topology
from pipefisher.planning.comm.actions import Action, ActionKind, Collective, CollectiveKind, CommPlan, GroupKey

WORLD: GroupKey = ("world",)
#: the ops that all-reduce over their rank's tensor-parallel processes: a forward (row-split
#: layers' outputs) and a backward (column-split layers' input gradients; a split backward's
#: weight gradient needs none)
TENSOR_KINDS = frozenset({OpKind.FORWARD, OpKind.BACKWARD})
#: the `model.recompute` modes whose recomputed modules hold row-split layers, so that each
#: backward all-reduces their forward's outputs again: blocks (a block's attention and MLP output
#: projections); selective recomputes the attention core, which holds none
REDUCING_RECOMPUTE = frozenset({"blocks"})


def shard_key(key: GroupKey, shard: int, topology: Topology) -> GroupKey:
    """The communicator that shard `shard`'s processes use for the rank-level communicator `key`."""
    if topology.tensor_parallel == 1 or key == WORLD:
        return key
    return (*key, f"shard{shard}")


def tensor_key(rank: int) -> GroupKey:
    """The communicator of `rank`'s tensor-parallel processes."""
    return ("tensor", rank)


def tensor_collective(rank: int, op: Op) -> Collective:
    """The all-reduces inside `op` over `rank`'s tensor-parallel processes, as one collective."""
    return Collective(CollectiveKind.TENSOR, tensor_key(rank), (str(op),))


def tensor_collectives(rank: int, op: Op, recompute: str = "none") -> tuple[Collective, ...]:
    """The collectives the replay counts for the all-reduces inside `op` (a forward, a backward
    or an op of `CommPlan.tensor_ops`) over `rank`'s tensor-parallel processes, in issue order:
    under a `recompute` mode of `REDUCING_RECOMPUTE` a backward's recomputed forwards' (keyed
    ``(op, "recomputed")``), then the op's own."""
    own = tensor_collective(rank, op)
    if op.kind is OpKind.BACKWARD and recompute in REDUCING_RECOMPUTE:
        return (Collective(CollectiveKind.TENSOR, own.group, (*own.key, "recomputed")), own)
    return (own,)


def process_members(topology: Topology, members: dict[GroupKey, tuple[int, ...]]) -> dict[GroupKey, tuple[int, ...]]:
    """Every communicator of the processes and its processes, from the rank-level `members`."""
    shards = range(topology.tensor_parallel)
    found: dict[GroupKey, tuple[int, ...]] = {}
    for key, ranks in members.items():
        if key == WORLD:
            found[key] = tuple(range(topology.processes))
            continue
        for shard in shards:
            found[shard_key(key, shard, topology)] = tuple(topology.process(rank, shard) for rank in ranks)
    if topology.tensor_parallel > 1:
        for rank in range(topology.world_size):
            found[tensor_key(rank)] = tuple(topology.process(rank, shard) for shard in shards)
    return found


def _process_action(action: Action, shard: int, topology: Topology) -> Action:
    target = action.target
    if isinstance(target, Collective):
        target = Collective(target.kind, shard_key(target.group, shard, topology), target.key)
    if action.group is None:
        return Action(action.kind, target)
    assert action.peer is not None, action  # POST and SEND name a peer with their communicator
    return Action(action.kind, target, shard_key(action.group, shard, topology), topology.process(action.peer, shard))


def process_programs(plan: CommPlan) -> tuple[list[tuple[Action, ...]], dict[GroupKey, tuple[int, ...]]]:
    """(every process's actions over the cycle, every communicator's processes): the ranks'
    actions on their shard's communicators, each forward and backward, and each op of
    `plan.tensor_ops`, followed by its tensor-parallel all-reduces (`tensor_collectives`, each
    launched and waited for at once: the op blocks on them)."""
    topology = plan.topology
    programs = []
    for process in range(topology.processes):
        rank, shard = topology.rank_of_process(process)
        program: list[Action] = []
        for step in plan.steps:
            for action in step[rank]:
                program.append(_process_action(action, shard, topology))
                if (
                    topology.tensor_parallel > 1
                    and action.kind is ActionKind.RUN
                    and (action.op.kind in TENSOR_KINDS or action.op in plan.tensor_ops)
                ):
                    for collective in tensor_collectives(rank, action.op, plan.recompute):
                        program += [Action(ActionKind.LAUNCH, collective), Action(ActionKind.WAIT, collective)]
        programs.append(tuple(program))
    return programs, process_members(topology, plan.members)
