"""ZeRO-1's layout (pure Python) and its place in the communication plan."""

import itertools
import random

import pytest

from pipefisher.core.topology import Topology
from pipefisher.planning.comm.actions import ActionKind, GradientPath, Reduction, gather_collective
from pipefisher.planning.comm.plan import plan_actions
from pipefisher.planning.comm.replay import replay
from pipefisher.planning.replicas.zero import contiguous_shards, shard_owners
from pipefisher.runtime.pipeline.plan_runner import schedule_plan
from pipefisher.schedules import get_schedule


def best_largest_run(sizes, parts):
    """The smallest possible largest run, by trying every placement of the cuts."""
    best = sum(sizes)
    for cuts in itertools.combinations_with_replacement(range(len(sizes) + 1), parts - 1):
        bounds = (0, *cuts, len(sizes))
        best = min(best, max(sum(sizes[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


@pytest.mark.parametrize("seed", range(30))
def test_contiguous_shards_are_optimal_and_cover_every_parameter_once(seed):
    rng = random.Random(seed)
    sizes = [rng.choice([1, 16, 48, 256, 1024]) for _ in range(rng.randint(1, 7))]
    parts = rng.randint(1, 4)
    cuts = contiguous_shards(sizes, parts)
    assert len(cuts) == parts + 1 and cuts[0] == 0 and cuts[-1] == len(sizes) and cuts == sorted(cuts)
    assert max(sum(sizes[a:b]) for a, b in zip(cuts, cuts[1:])) == best_largest_run(sizes, parts)


def test_owners_follow_the_runs_and_fewer_parameters_than_ranks_leave_ranks_empty():
    assert shard_owners([10, 10, 10, 10], (4, 5)) == [4, 4, 5, 5]
    assert shard_owners([30, 1, 1, 1], (0, 2)) == [0, 2, 2, 2]
    assert shard_owners([5], (1, 3, 5)) == [1]
    with pytest.raises(ValueError, match="parts"):
        contiguous_shards([1], 0)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "chimera"])
def test_sharded_plans_broadcast_after_the_world_reduction_and_replay_under_nccl_rules(schedule):
    topology = Topology(get_schedule(schedule, 2, 4, 2 if schedule == "interleaved" else None), data_parallel=2)
    comm = replay(
        plan_actions(topology, schedule_plan(topology.schedule), tied=True, path=GradientPath(Reduction.SHARDED))
    )
    for rank, actions in enumerate(comm.steps[0]):
        names = [str(action) for action in actions]
        stages = sorted({stage for _, stage in topology.stages_of(rank)})
        gathers = [gather_collective(stage) for stage in stages]
        assert names[-2 * len(stages) :] == [f"+{g}" for g in gathers] + [f"w:{g}" for g in gathers]
        assert names.index("w:step") < names.index(f"+{gathers[0]}")
        assert all(
            a.target.group == ("grad", a.target.key[0])
            for a in actions
            if a.kind is ActionKind.LAUNCH and a.target.kind == "gather"
        )
    unsharded = plan_actions(topology, schedule_plan(topology.schedule), tied=True)
    assert not any("gather" in str(a) for actions in unsharded.steps[0] for a in actions)
