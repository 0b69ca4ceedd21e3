"""ZeRO-2/3 on the pipeline (PyTorch's FSDP2 over each stage's replicas): trains like the
single-process reference under the in-order communication mode, with FSDP's collectives in the
replayed plan; what it does not run yet is refused in one line; checkpoints resume across ZeRO
degrees."""

import shutil

import pytest
import torch
from _workers import checkpointing, fsdp_calls_per_step
from _zero_runs import assert_sharded_equals_reference, train, zero_config
from builders import tiny_model

from pipefisher.config import ConfigError
from pipefisher.core.topology import Topology
from pipefisher.planning.comm.actions import ActionKind, CollectiveKind, CommOrderError, GradientPath, Reduction
from pipefisher.planning.comm.plan import plan_actions
from pipefisher.planning.comm.processes import process_programs
from pipefisher.planning.comm.replay import replay, replay_programs
from pipefisher.runtime.pipeline.plan_runner import schedule_plan
from pipefisher.runtime.training.checkpoint import step_folder
from pipefisher.runtime.training.launch import run_group
from pipefisher.runtime.training.reference import train_reference
from pipefisher.runtime.training.resumption import resumable_step
from pipefisher.schedules import SCHEDULES, get_schedule
from pipefisher.testing.harness import micro_batches_for

#: the schedules ZeRO-2/3 runs (chimera with data_parallel >= 2); the registry's others are refused
#: in one line (`REFUSED`)
RUNS = ("gpipe", "1f1b", "interleaved", "chimera")
#: schedule -> what its refusal says
REFUSED = {
    "zb-h1": "weight gradients run outside the backward",
    "zbv": "weight gradients run outside the backward",
    "dualpipev": "weight gradients run outside the backward",
}


def sharded_config(schedule, zero, stages=1, rule="adamw", **overrides):
    """`stages` stages x 2 replicas (`_zero_runs.zero_config`)."""
    return zero_config(schedule, zero, rule, stages, **overrides)


def assert_matches_reference(config):
    results = assert_sharded_equals_reference(config)
    assert all(record["grad_norm"] > 0 for _, records in results for record in records)
    if (
        config.optimizer.name == "adamw" and config.pipeline.tensor_parallel == 1
    ):  # two fp32 moments, each rank of a stage holding half
        for rank, (result, _) in enumerate(results):
            whole = 8 * sum(value.numel() for value in result.parameters.values())
            held = results[0][0].state_bytes[rank]["optimizer"]
            assert 0.45 * whole <= held <= 0.55 * whole, (rank, held, whole)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("zero", [2, 3])
def test_sharded_adamw_equals_the_reference(schedule, zero):
    assert_matches_reference(sharded_config(schedule, zero))


@pytest.mark.parametrize("stages", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_the_clipped_norm_sums_the_shards_over_replicas_and_stages(stages):
    """The global gradient norm every rank logs is the unsharded run's, and clipping acts."""
    config = sharded_config("1f1b", 3, stages=stages, optimizer={"clip_norm": 0.05})
    plain = train(config.with_overrides(optimizer={"zero": 0}))
    for (_, records), (_, plain_records) in zip(train(config), plain):
        norms = [record["grad_norm"] for record in records]
        torch.testing.assert_close(norms, [record["grad_norm"] for record in plain_records], rtol=1e-5, atol=0)
        assert max(norms) > 0.05, "clipping acts in some step"


@pytest.mark.parametrize("zero", [2, 3])
def test_gradients_are_reduce_scattered_once_per_step(zero):
    """One reduce-scatter per FSDP unit (each block and the stage) per step, not per micro-batch;
    ZeRO-2 gathers each unit once per step, ZeRO-3 in every forward and backward."""
    config = sharded_config("1f1b", zero)
    units, ops = tiny_model()["layers"] + 1, 2 * config.pipeline.micro_batches
    gathers = units if zero == 2 else ops * units
    for steps in run_group(fsdp_calls_per_step, 2, args=(config,), timeout=30, deadline=240):
        assert steps == [{"all_gather": gathers, "reduce_scatter": units}] * config.run.steps


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved", "chimera"])
def test_sharded_two_stages_equal_the_reference(schedule):
    """Chimera: 2 pipes x 2 replicas; each pipe's replicas shard a stage, the shards are then
    summed over the pipes (``grad_pipes``)."""
    assert_matches_reference(sharded_config(schedule, 3, stages=2))


@pytest.mark.slow
@pytest.mark.parametrize("zero", [2, 3])
def test_sharded_uneven_stages_equal_the_reference(zero):
    """`pipeline.stage_blocks` [3, 1] (what `pipefisher plan` may propose, ZeRO-2/3 included)."""
    assert_matches_reference(sharded_config("1f1b", zero, stages=2, pipeline={"stage_blocks": [3, 1]}))


def test_chimera_without_data_parallel_replicas_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^optimizer.zero: 3 \(FSDP2\) under chimera shards over a pipe's") as error:
        sharded_config("chimera", 3, stages=2, pipeline={"data_parallel": 1})
    assert "\n" not in str(error.value)


@pytest.mark.slow
def test_sharded_tensor_parallel_stages_equal_the_reference():
    """2 replicas x 2 tensor-parallel shards: FSDP2 shards each tensor-parallel shard's
    parameters over its replicas; the clipped norm counts what the shards hold whole once."""
    assert_matches_reference(sharded_config("1f1b", 3, pipeline={"tensor_parallel": 2}))


def test_sharded_bf16_equals_the_bf16_reference():
    """bf16 autocast over FSDP2's gathered fp32 parameters, each forward casting them anew (a cast
    kept for the whole step, as unsharded runs keep it, loses part of the gradient here: the
    step's gradient norm comes out 13 % low on this run)."""
    config = sharded_config("1f1b", 3, run={"precision": "bf16"})
    reference = train_reference(config.with_overrides(optimizer={"zero": 0}))
    for result, _ in train(config):
        torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(reference.losses), rtol=1e-4, atol=0)
        for key, value in result.parameters.items():
            torch.testing.assert_close(value, reference.parameters[key], rtol=1e-4, atol=1e-6, msg=key)


@pytest.mark.slow
def test_sharded_sgd_with_momentum_equals_the_reference():
    assert_matches_reference(sharded_config("1f1b", 2, rule="sgd", optimizer={"momentum": 0.9}))


@pytest.mark.parametrize(("before", "after"), [(3, 1), (1, 2)])
def test_a_checkpoint_resumes_across_zero_degrees(before, after, tmp_path):
    """Saved whole under layout-free keys: a ZeRO-3 run resumed as ZeRO-1 (and ZeRO-1 as ZeRO-2)
    takes steps 3-4 as the uninterrupted run did."""
    directory = tmp_path / "checkpoints"
    straight_config = sharded_config("1f1b", before, run={"steps": 4}, checkpoint={"dir": str(directory), "every": 2})
    straight = run_group(checkpointing, 2, args=(straight_config, False), timeout=30, deadline=240)
    shutil.rmtree(step_folder(str(directory), 4))
    resumed_config = straight_config.with_overrides(optimizer={"zero": after})
    assert resumable_step(str(directory), resumed_config)[0] == 2
    resumed = run_group(checkpointing, 2, args=(resumed_config, True), timeout=30, deadline=240)
    for result, whole in zip(resumed, straight):
        torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(whole.losses[2:]), rtol=1e-5, atol=0)
        for key, value in result.parameters.items():
            torch.testing.assert_close(value, whole.parameters[key], rtol=1e-5, atol=1e-6, msg=key)


def test_every_schedule_of_the_registry_runs_or_is_refused_in_one_line():
    assert set(RUNS) | set(REFUSED) == set(SCHEDULES)
    for name in SCHEDULES:
        pipeline = {"stages": 2, "micro_batches": micro_batches_for(name), "schedule": name}
        if name in RUNS:
            assert sharded_config(name, 3, pipeline=pipeline).gradient_path.reduction is Reduction.FSDP_PARAMETERS
            continue
        with pytest.raises(
            ConfigError, match=rf"^optimizer.zero: 2 \(FSDP2\) under {name}: .*{REFUSED[name]}"
        ) as error:
            sharded_config(name, 2, pipeline=pipeline)
        assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"optimizer": {"name": "lamb"}}, r"^optimizer.zero: 3 \(FSDP2\) with lamb: its trust ratio"),
        ({"run": {"precision": "fp16"}}, r"^optimizer.zero: 3 \(FSDP2\) with run.precision fp16"),
        ({"run": {"compile": True}}, r"^optimizer.zero: 3 \(FSDP2\) with compiled blocks"),
        ({"comm": {"powersgd_rank": 2}}, r"^comm.powersgd_rank: "),
    ],
)
def test_what_sharding_does_not_run_yet_is_refused_in_one_line(overrides, says):
    with pytest.raises(ConfigError, match=says) as error:
        sharded_config("1f1b", 3, **overrides)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("name", RUNS)
def test_fsdp_collectives_are_in_the_replayed_plan(name):
    """Every forward and backward of a replicated stage waits for its all-gathers (``unshard``)
    before it runs; the stage's last backward of the step carries its one reduce-scatter
    (``grad``), launched right before it and waited for right after; the plan replays under
    NCCL's rule, and a replica whose ops gather in another order is caught. Chimera: on each
    pipe's own communicator, the shards then summed over the pipes once (``grad_pipes``)."""
    schedule = get_schedule(name, 2, micro_batches_for(name), 2 if name == "interleaved" else 1)
    topology = Topology(schedule, data_parallel=2)
    plan = replay(plan_actions(topology, schedule_plan(schedule), path=GradientPath(Reduction.FSDP_PARAMETERS)))
    for rank, actions in enumerate(plan.steps[0]):
        runs = [i for i, a in enumerate(actions) if a.kind is ActionKind.RUN]
        for i in runs:
            gather = actions[i - 2] if actions[i - 1].kind is ActionKind.WAIT else actions[i - 3]
            assert gather.kind is ActionKind.LAUNCH and gather.collective.kind is CollectiveKind.UNSHARD, actions[i]
            assert gather.collective.key == (actions[i].op.stage, str(actions[i].op))
        reductions = [
            i
            for i, a in enumerate(actions)
            if a.kind is not ActionKind.RUN
            and isinstance(a.target, type(gather.target))
            and a.target.kind is CollectiveKind.GRAD
        ]
        stages = {actions[i].op.stage for i in runs}
        assert len(reductions) == 2 * len(stages), "one launch and one wait per stage"
        for launch in reductions[::2]:
            last = max(i for i in runs if actions[i].op.stage == actions[launch].collective.key[0])
            assert launch == last - 1 and actions[last + 1] == actions[launch].__class__(
                ActionKind.WAIT, actions[launch].target
            )
        pipe_sums = [
            a.collective for a in actions if a.kind is ActionKind.LAUNCH and a.target.kind is CollectiveKind.GRAD_PIPES
        ]
        assert len(pipe_sums) == (len(stages) if schedule.num_pipes > 1 else 0)
    programs, members = process_programs(plan)
    replica = topology.rank(1, 0, 0)  # stage 0's second replica (in pipe 0)
    other = list(programs[replica])
    gathers = [
        i for i, a in enumerate(other) if a.kind is ActionKind.LAUNCH and a.collective.kind is CollectiveKind.UNSHARD
    ]
    for first, second in ((gathers[0], gathers[1]), (gathers[0] + 1, gathers[1] + 1)):
        other[first], other[second] = other[second], other[first]
    programs[replica] = tuple(other)
    with pytest.raises(CommOrderError, match=r"mismatch on (grad/0|shard/0/0)|deadlock under NCCL"):
        replay_programs(programs, members)


@pytest.mark.slow
def test_a_zero3_checkpoint_resumes_on_another_replica_count(tmp_path):
    """ZeRO-3 over 2 replicas of 1 stage, resumed as ZeRO-2 on 2 stages without replicas (8
    micro-batches: the same global batch): steps 3-4 as the uninterrupted run took them."""
    directory = tmp_path / "checkpoints"
    straight_config = sharded_config("1f1b", 3, run={"steps": 4}, checkpoint={"dir": str(directory), "every": 2})
    straight = run_group(checkpointing, 2, args=(straight_config, False), timeout=30, deadline=240)
    shutil.rmtree(step_folder(str(directory), 4))
    resumed_config = straight_config.with_overrides(
        optimizer={"zero": 2}, pipeline={"stages": 2, "data_parallel": 1, "micro_batches": 8}
    )
    resumed = run_group(checkpointing, 2, args=(resumed_config, True), timeout=30, deadline=240)
    # the parameters by the 2-stage layout's names: the straight run equals the reference
    reference = train_reference(resumed_config.with_overrides(optimizer={"zero": 0}, checkpoint={"dir": ""}))
    torch.testing.assert_close(torch.tensor(reference.losses), torch.tensor(straight[0].losses), rtol=1e-5, atol=0)
    for result in resumed:
        torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(straight[0].losses[2:]), rtol=1e-5, atol=0)
        for key, value in result.parameters.items():
            torch.testing.assert_close(value, reference.parameters[key], rtol=1e-5, atol=1e-6, msg=key)
