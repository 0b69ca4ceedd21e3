"""PipeFisher end to end: K-FAC on the executor equals the single-process reference K-FAC."""

import json
import statistics
import subprocess
from pathlib import Path

import pytest
import torch

from _workers import assert_equal_to_reference, pipelined, profiled_midway
from pipefisher.config import config_from_dict, load_config
from pipefisher.core.profile import load_profile
from pipefisher.runtime.training.assembly import staged_model
from pipefisher.runtime.training.launch import run_group
from pipefisher.runtime.training.reference import train_reference
from pipefisher.schedules import SCHEDULES
from builders import tiny_model
from sweeps import dealt, pipeline

pytestmark = pytest.mark.dist
TINY = Path(__file__).resolve().parents[2] / "schedules" / "tiny-regression.yaml"


def kfac_config(schedule, placement, data_parallel=1, **kfac):
    """The tuned settings of the earlier tests (test_curvature_equivalence.py sweeps the shipped
    defaults): K-FAC's SGD at lr 0.1 with momentum 0.9, AdamW at 0.01 for the LayerNorms (at 0.1
    their steps amplify Chimera's rounding beyond rtol 1e-5). Two stages, in-order mode (NCCL's
    rule on gloo), a profile measured before training."""
    return config_from_dict(
        {
            "model": tiny_model(),
            "data": {"micro_batch_size": 2},
            "pipeline": pipeline(schedule, data_parallel=data_parallel),
            "optimizer": {"name": "kfac", "lr": 0.01},
            "kfac": {
                "lr": 0.1,
                "momentum": 0.9,
                "refresh_steps": 2,
                "placement": placement,
                "factor_decay": 0.5,
                "damping": 0.01,
                **kfac,
            },
            "run": {"steps": 5, "timeout": 30, "master_port": 0, "in_order": True},
        }
    )


#: K-FAC's damped inverses amplify the last-bit differences of sums taken in another order (micro-
#: batches across replicas, the all-reduce): over 8 seeds the parameters differ by up to 1e-4
#: while every loss agrees to 1e-5
PARAMETER_ATOL = 2e-4


@pytest.mark.parametrize("placement", ["packed", "after-step"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_kfac_on_the_pipeline_equals_the_reference(schedule, placement):
    reference = assert_equal_to_reference(kfac_config(schedule, placement), PARAMETER_ATOL)
    first_order = train_reference(
        kfac_config(schedule, placement).with_overrides(optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9})
    )
    assert reference.losses[2:] != pytest.approx(first_order.losses[2:]), "K-FAC changed the updates from the 2nd cycle"


@pytest.mark.slow
@pytest.mark.parametrize("schedule", dealt(2, 4))
def test_kfac_with_data_parallel_replicas_equals_the_reference(schedule):
    """Factors are synced over every replica of a stage (pipes x data-parallel copies);
    after-step placement computes the same bit for bit (below). A quarter of the schedules here
    (those the shipped-defaults sweep pairs with other methods), one in test_shampoo_pipeline.py's
    copy of this test; test_curvature_equivalence.py's pairs give every schedule two copies."""
    assert_equal_to_reference(kfac_config(schedule, "packed", data_parallel=2), PARAMETER_ATOL)


@pytest.mark.parametrize("schedule", dealt(1, 2))
def test_packed_and_after_step_placements_are_bitwise_identical(schedule):
    """Plans differ in when curvature runs; factors still sum their micro-batches in order.
    Half the schedules here, a quarter in test_shampoo_pipeline.py's copy of this test."""
    runs = {}
    for placement in ("packed", "after-step"):
        config = kfac_config(schedule, placement)
        runs[placement] = run_group(pipelined, config.world_size, args=(config,), timeout=30, deadline=180)[0]
    packed, after_step = runs["packed"], runs["after-step"]
    assert packed.losses == after_step.losses
    assert all(torch.equal(value, after_step.parameters[key]) for key, value in packed.parameters.items())


def test_kfac_without_inverse_splitting_and_with_reprofiling_equals_the_reference(capfd):
    # Cycles of 2 steps: the 1st warms up, the 2nd calibrates the fresh profile, the 3rd drifts and
    # step 7 runs on the new plan (a smaller lr keeps 7 K-FAC steps' float rounding below rtol).
    config = kfac_config("chimera", "packed", split=False, reprofile_threshold=1e-6, reprofile_patience=1, lr=0.03)
    assert_equal_to_reference(config.with_overrides(run={"steps": 7}), PARAMETER_ATOL)
    assert "re-profiling and re-packing" in capfd.readouterr().err


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    folder = tmp_path_factory.mktemp("profile")
    profile, timeline = folder / "tiny.yaml", folder / "tiny-timeline.json"
    result = subprocess.run(
        [
            "pipefisher",
            "profile",
            str(TINY),
            "-o",
            str(profile),
            "--timeline",
            str(timeline),
            "--master-port",
            "0",
            "--repeats",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    return profile, timeline


def test_measured_profile_loads_in_pack_and_viz(measured, tmp_path):
    profile_path, timeline_path = measured
    profile = load_profile(profile_path)
    assert profile.num_stages == 2 and all(stage.forward > 0 and stage.backward > 0 for stage in profile.stages)
    assert all(stage.step_end > 0 for stage in profile.stages), "the optimizer step takes time"
    assert [layer.name for layer in profile.stages[0].layers][:2] == ["embed", "blocks.0.attention.query"]
    assert all(
        layer.time("curvature", 0) > 0 and layer.time("curvature", 1) > 0 and layer.time("refresh", 0) > 0
        for s in profile.stages
        for layer in s.layers
    )
    packed = subprocess.run(
        ["pipefisher", "pack", "--profile", str(profile_path), "--schedule", "1f1b", "-D", "2", "-N", "4", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert packed.returncode == 0, packed.stderr
    assert json.loads(packed.stdout)["refresh_steps"] >= 1
    picture = tmp_path / "measured.txt"
    drawn = subprocess.run(
        ["pipefisher", "viz", "--timeline", str(timeline_path), "-o", str(picture)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert drawn.returncode == 0, drawn.stderr
    assert picture.read_text().count("rank") >= 2


def test_measured_profile_keeps_its_samples_and_the_capture_sizes(measured):
    """Every time is the median of its samples (--repeats 2 steps of 4 micro-batches; one
    curvature per micro-batch); capture sizes are those of the fp32 tensors the engine stores:
    micro_batch_size x seq_len rows, in_features (A) and out_features (B) wide."""
    profile, config = load_profile(measured[0]), load_config(TINY)
    micro_batches = config.pipeline.micro_batches
    rows = config.data.micro_batch_size * config.model.seq_len
    model = staged_model(config)
    stages = [model.build_stage(index, profile.num_stages, seed=0) for index in range(profile.num_stages)]
    linears = {
        name: module
        for stage in stages
        for name, module in stage.named_modules()
        if isinstance(module, torch.nn.Linear)
    }
    for stage in profile.stages:
        assert len(stage.samples["forward"]) == len(stage.samples["backward"]) == 2 * micro_batches
        assert set(stage.samples) >= {"forward", "backward", "step_end"}
        for layer in stage.layers:
            assert len(layer.samples["curvature.0"]) == len(layer.samples["curvature.1"]) == micro_batches
            assert set(layer.samples) == {
                "curvature.0",
                "curvature.1",
                "refresh.0",
                "refresh.1",
                "precondition",
            }  # no replicas: no sync
            assert layer.captured(0) == rows * linears[layer.name].in_features * 4
            assert layer.captured(1) == rows * linears[layer.name].out_features * 4
        for item in (stage, *stage.layers):
            assert all(_time(item, key) == statistics.median(values) for key, values in item.samples.items())
    assert len(profile.stages[0].samples["p2p"]) >= 2


def test_run_with_the_measured_profile(measured):
    result = subprocess.run(
        [
            "pipefisher",
            "run",
            str(TINY),
            "--optimizer",
            "kfac",
            "--profile",
            str(measured[0]),
            "--kfac-refresh-steps",
            "1",
            "--kfac.reprofile_patience",
            "100",  # the plan stays (a re-plan re-measures the exposed time): a loaded machine drifts
            "--steps",
            "4",
            "--json",
            "--master-port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    assert all(line["refresh_steps"] == 1 and line["predicted_step_time_ms"] > 0 for line in lines)
    assert "K-FAC packed: refresh every" in result.stderr
    # the exposed optimizer time, measured on step 2 (the first cycle after the warm-up step 1)
    assert "exposed_share" not in lines[0]
    for line in lines[1:]:
        assert line["exposed_steps"] == [2, 2] and line["exposed_measured_step_time_ms"] == lines[1]["step_time_ms"]
        first_order, share = line["exposed_first_order_step_time_ms"], line["exposed_share"]
        assert first_order > 0 and share >= 0
        assert line["exposed_step_time_ms"] == pytest.approx(first_order * (1 + share))
    assert "exposed optimizer time +" in result.stderr


def test_a_profile_of_another_run_is_refused(tmp_path, measured):
    other = tmp_path / "other.yaml"
    other.write_text(TINY.read_text().replace("layers: 4", "layers: 2"))
    result = subprocess.run(
        ["pipefisher", "run", str(other), "--optimizer", "kfac", "--profile", str(measured[0])],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "stages[0].layers do not match the model" in result.stderr and result.stderr.count("\n") == 1
    three = tmp_path / "three.yaml"
    three.write_text(TINY.read_text().replace("stages: 2", "stages: 4").replace("micro_batches: 4", "micro_batches: 8"))
    result = subprocess.run(
        ["pipefisher", "run", str(three), "--optimizer", "kfac", "--profile", str(measured[0])],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "profile has 2 stages but the schedule needs 4" in result.stderr


@pytest.mark.parametrize("optimizer", ["lamb", "adamw", "kfac"])
def test_measuring_a_profile_mid_run_leaves_no_trace(optimizer):
    """The profiler's steps drop their gradients and its end-of-step timing restores parameters,
    optimizer state and learning-rate schedule: training continues bit for bit (kfac: its
    optimizer, SGD and AdamW for the rest, on a plan without curvature work)."""
    config = config_from_dict(
        {
            "model": tiny_model(),
            "data": {"micro_batch_size": 2},
            "pipeline": {"stages": 2, "micro_batches": 4, "schedule": "1f1b"},
            "optimizer": {
                "name": optimizer,
                "lr": 0.01,
                "weight_decay": 0.01,
                "clip_norm": 0.5,
                "warmup_steps": 2,
                "decay": "linear",
                "decay_steps": 6,
            },
            "run": {"steps": 4, "timeout": 30, "master_port": 0},
        }
    )
    plain, profiled = (
        run_group(profiled_midway, 2, args=(config, flag), timeout=30, deadline=120) for flag in (False, True)
    )
    for (losses, state), (losses_profiled, state_profiled) in zip(plain, profiled):
        assert losses == losses_profiled
        assert state.keys() == state_profiled.keys()
        for key, value in state.items():
            assert value == state_profiled[key] if key == "lr" else torch.equal(value, state_profiled[key]), key


@pytest.mark.parametrize("placement", ["packed", "after-step"])
def test_kfac_resumes_mid_cycle_bit_for_bit_with_collectives_in_flight(placement, tmp_path):
    """Chimera syncs factors and exchanges inverses between its pipes, launched in one step and
    waited for in a later one: checkpoints at every step boundary finish what can finish, and a
    run resumed mid-cycle counts those as done and launches its part of the rest again."""
    from _workers import assert_resumes_bit_for_bit

    sections = {
        "kfac": {"refresh_steps": 3, "placement": placement, "factor_decay": 0.5, "damping": 0.01},
        "run": {"steps": 6},
    }
    assert_resumes_bit_for_bit(kfac_config("chimera", placement).with_overrides(**sections), 4, tmp_path)


@pytest.mark.slow
def test_a_resumed_rank_launches_again_its_part_of_collectives_its_peers_launch_later(tmp_path):
    """Chimera on 4 stages with this profile: at the boundary after a cycle's first step, ranks 1
    and 3 have launched inverse exchanges their peers launch only in the next step. The checkpoint
    there leaves them in flight; the resumed ranks launch them again."""
    from _workers import assert_resumes_bit_for_bit, unit_profile
    from pipefisher.planning.comm.plan import plan_actions
    from pipefisher.planning.comm.replay import replay
    from pipefisher.runtime.training.assembly import build_schedule
    from pipefisher.runtime.training.pipefisher_run import make_plan
    from pipefisher.core.topology import Topology

    config = kfac_config("chimera", "packed").with_overrides(
        model={"layers": 4},
        pipeline={"stages": 4, "micro_batches": 8},
        kfac={"refresh_steps": 3, "profile": str(tmp_path / "profile.yaml")},
        run={"steps": 5},
    )
    schedule = build_schedule(config)
    profile = unit_profile(config, schedule.num_stages, inverse=0.3, sync=0.5)
    profile.save(tmp_path / "profile.yaml")
    comm = replay(plan_actions(Topology(schedule), make_plan(config, schedule, profile).plan))
    assert any(comm.outstanding(1, rank)[1] for rank in range(4)), "the case this test is about"
    assert_resumes_bit_for_bit(config, 4, tmp_path)


def _time(item, key: str) -> float:
    """The time of field `key` of a stage or a layer (``refresh.1``: a layer's part 1 refresh)."""
    work, _, part = key.partition(".")
    return item.time(work, int(part)) if part else getattr(item, key)
