"""KAISA's gradient-worker grid and its place in the plans (pure Python)."""

import pytest

from builders import layered_profile, rules_of
from pipefisher.config import ConfigError, config_from_dict
from pipefisher.core.ir import OpKind
from pipefisher.core.topology import Topology
from pipefisher.planning.comm.actions import ActionKind, GradientPath, Reduction
from pipefisher.planning.comm.plan import plan_actions
from pipefisher.planning.comm.replay import replay
from pipefisher.planning.replicas.kaisa import grad_workers, worker_count
from pipefisher.planning.packing.pack import PackOptions, pack
from pipefisher.schedules import get_schedule


@pytest.mark.parametrize("replicas", [1, 2, 4, 6, 8])
def test_every_usable_fraction_gives_a_grid_where_each_block_has_one_worker_per_layer(replicas):
    ranks = tuple(range(10, 10 + 3 * replicas, 3))
    for workers in (d for d in range(1, replicas + 1) if replicas % d == 0):
        grid = grad_workers(reversed(ranks), workers / replicas)
        assert grid.workers == workers and grid.ranks == ranks
        for layer in range(7):
            holders = [rank for rank in ranks if grid.works_for(rank, layer)]
            assert len(holders) == workers, "f x R workers per layer"
            assert sorted(grid.block(rank) for rank in holders) == list(range(workers)), "one in each block"
        kept = [len(grid.layers_of(rank, 12)) for rank in ranks]
        assert max(kept) - min(kept) <= 1 and sum(kept) == 12 * workers, "layers spread evenly"


def test_memory_and_communication_optimal_ends():
    every = grad_workers((0, 1, 2, 3), 1.0)
    assert all(every.works_for(rank, layer) for rank in range(4) for layer in range(5))
    one = grad_workers((0, 1, 2, 3), 0.25)
    assert [one.worker(layer, 0) for layer in range(6)] == [0, 1, 2, 3, 0, 1] and one.block_ranks(0) == (0, 1, 2, 3)


@pytest.mark.parametrize("fraction", [0.3, 0.0, 1.5, 2 / 3])
def test_fractions_that_are_not_a_whole_divisor_are_refused_with_the_usable_ones(fraction):
    with pytest.raises(ValueError, match="use 0.25, 0.5, 1"):
        worker_count(4, fraction)
    with pytest.raises(ConfigError, match=r"kfac.grad_worker_fraction: .* use 0.25, 0.5, 1"):
        config_from_dict(
            {
                "optimizer": {"name": "kfac"},
                "pipeline": {"schedule": "chimera", "data_parallel": 2},
                "kfac": {"grad_worker_fraction": fraction},
            }
        )


def test_gradient_workers_and_zero1_do_not_combine():
    with pytest.raises(ConfigError, match="use kfac.grad_worker_fraction 1 or optimizer.zero 0"):
        config_from_dict(
            {
                "optimizer": {"name": "kfac", "zero": 1},
                "pipeline": {"data_parallel": 2},
                "kfac": {"grad_worker_fraction": 0.5},
            }
        )
    with pytest.raises(ValueError, match="ZeRO-1 reduces to owners"):
        GradientPath(Reduction.SHARDED, workers_per_layer=1)
    assert GradientPath(Reduction.COMPRESSED, workers_per_layer=1).compressed, "PowerSGD and gradient workers combine"


@pytest.mark.parametrize("schedule", ["1f1b", "chimera"])
def test_plans_with_gradient_workers_drop_the_precondition_op_and_broadcast_in_blocks(schedule):
    sched = get_schedule(schedule, 2, 4)
    topology = Topology(sched, data_parallel=2)
    profile = layered_profile(2, 3, spread=False, inverse=0.6, sync=0.1, names="layer{i}")
    plan = pack(
        sched, profile, rules_of(profile), PackOptions(data_parallel=2, precondition=False, refresh_steps=2)
    ).plan
    assert not any(op.kind is OpKind.PRECONDITION for step in plan.steps for ops in step for op in ops)
    replicas = len(topology.replica_ranks(0))
    for workers in (d for d in range(1, replicas) if replicas % d == 0):
        comm = replay(plan_actions(topology, plan, path=GradientPath(workers_per_layer=workers)))
        for rank, actions in enumerate(comm.steps[0]):
            names = [str(a) for a in actions]
            launched = [a.target for a in actions if a.kind is ActionKind.LAUNCH and a.target.kind == "pgrad"]
            assert [c.key[0] for c in launched] == sorted({stage for _, stage in topology.stages_of(rank)})
            assert all(
                len(comm.members[c.group]) == replicas // workers and rank in comm.members[c.group] for c in launched
            )
            assert names.index(f"+{launched[-1]}") < names.index("+step"), "preconditioned before the norm"


def test_the_cli_refuses_an_unusable_fraction_in_one_line():
    import subprocess
    from pathlib import Path

    demo = Path(__file__).resolve().parents[1] / "schedules" / "tiny-cpu.yaml"
    result = subprocess.run(
        [
            "pipefisher",
            "run",
            str(demo),
            "--optimizer",
            "kfac",
            "--data-parallel",
            "2",
            "--kfac-grad-worker-fraction",
            "0.3",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "pipefisher: error: kfac.grad_worker_fraction: 0.3 x 2 replicas of each stage is not a whole divisor of 2; use 0.5, 1"
    ]
