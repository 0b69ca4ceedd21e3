"""The communicators of a run and their global ranks (see `pipefisher.planning.comm.plan` for
what each carries). Pure Python: no torch."""

from __future__ import annotations

from pipefisher.core.topology import Topology
from pipefisher.planning.comm.actions import GradientPath, GroupKey
from pipefisher.planning.replicas.kaisa import GradWorkers


def tied_ranks_of(topology: Topology) -> tuple[int, ...]:
    """The ranks holding the first or the last stage (tied weights' copies); () with one stage."""
    last = topology.schedule.num_stages - 1
    if last == 0:
        return ()
    return tuple(sorted(set(topology.replica_ranks(0)) | set(topology.replica_ranks(last))))


def group_members(
    topology: Topology, tied: bool, path: GradientPath = GradientPath(), helpers: bool = False
) -> dict[GroupKey, tuple[int, ...]]:
    """Every communicator of a run and its global ranks (see the module docstring); `helpers`:
    one for every ordered pair of ranks (`help_groups`)."""
    tied_ranks = tied_ranks_of(topology) if tied else ()
    schedule = topology.schedule
    members: dict[GroupKey, tuple[int, ...]] = {("world",): tuple(range(topology.world_size))}
    if tied_ranks:
        members[("tied",)] = tied_ranks
    for stage in range(schedule.num_stages):
        ranks = topology.replica_ranks(stage)
        if len(ranks) > 1:
            members[("grad", stage)] = members[("curv", stage)] = ranks
            if path.workers_per_layer is not None:
                grid = GradWorkers(ranks, path.workers_per_layer)
                for block in range(grid.workers):
                    members[("pgrad", stage, block)] = grid.block_ranks(block)
    if path.fsdp and schedule.num_pipes > 1:
        members.update(_fsdp_pipe_groups(topology))
    if helpers:
        members.update(help_groups(topology))
    for replica in range(topology.data_parallel):
        for pipe in range(schedule.num_pipes):
            for stage in range(schedule.num_stages - 1):
                low, high = topology.rank(replica, pipe, stage), topology.rank(replica, pipe, stage + 1)
                if low != high:
                    members[("fwd", replica, pipe, stage)] = (low, high)
                    members[("bwd", replica, pipe, stage)] = (high, low)
    return members


def help_groups(topology: Topology) -> dict[GroupKey, tuple[int, ...]]:
    """``("help", owner, helper)`` for every ordered pair of ranks: a helped stage's rank and a
    rank that does part of its per-step work (one pipeline, no replicas, one process per rank:
    the layouts where a stage has a precondition op of its own); none for other layouts."""
    if topology.data_parallel > 1 or topology.tensor_parallel > 1 or topology.schedule.num_pipes > 1:
        return {}
    ranks = range(topology.world_size)
    return {("help", owner, helper): (owner, helper) for owner in ranks for helper in ranks if owner != helper}


def _fsdp_pipe_groups(topology: Topology) -> dict[GroupKey, tuple[int, ...]]:
    """ZeRO-2/3 with several pipes: per stage and pipe, the data-parallel copies FSDP2 shards over
    (``("shard", stage, pipe)``); per stage and data-parallel replica, the copies in every pipe
    whose shards are summed (``("pipes", stage, replica)``)."""
    schedule, replicas = topology.schedule, range(topology.data_parallel)
    groups: dict[GroupKey, tuple[int, ...]] = {}
    for stage in range(schedule.num_stages):
        for pipe in range(schedule.num_pipes):
            groups[("shard", stage, pipe)] = tuple(topology.rank(replica, pipe, stage) for replica in replicas)
        for replica in replicas:
            groups[("pipes", stage, replica)] = tuple(
                topology.rank(replica, pipe, stage) for pipe in range(schedule.num_pipes)
            )
    return groups
