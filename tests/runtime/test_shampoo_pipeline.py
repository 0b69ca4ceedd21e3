"""Shampoo on the executor: packed, after-step and single-process reference runs agree for every
schedule, with data-parallel replicas, in the NCCL-order test mode; profiles, checkpoints and the
CLI serve it like K-FAC."""

import json
import subprocess
from pathlib import Path

import pytest
import torch

from _workers import assert_equal_to_reference, assert_resumes_bit_for_bit, pipelined, profiled_by_the_cli
from pipefisher.config import config_from_dict
from pipefisher.runtime.training.launch import run_group
from pipefisher.runtime.training.reference import train_reference
from pipefisher.schedules import SCHEDULES
from builders import tiny_model
from sweeps import dealt, pipeline

pytestmark = pytest.mark.dist
#: parameters agree to this absolute tolerance besides rtol 1e-5 (see `shampoo_config` for why the
#: epsilons are what they are)
PARAMETER_ATOL = 1e-6
TINY = Path(__file__).resolve().parents[2] / "schedules" / "tiny-regression.yaml"


def shampoo_config(schedule, placement, data_parallel=1, **shampoo):
    """The tuned settings of the earlier tests (test_curvature_equivalence.py sweeps the shipped
    defaults). Two stages of a 4-block transformer, in-order mode (NCCL's rule on gloo), a
    profile measured before training, refresh every 2 steps, Adam grafting; block_size 12 cuts
    the 16 x 32 and 32 x 16 feed-forward weights into blocks. Adam's epsilon (optimizer.eps) is 1e-3: the
    attention's key biases have a zero gradient in exact arithmetic (softmax ignores them), and
    a smaller epsilon would amplify its rounding noise, which differs between any two orders of
    summation, into full-size steps. Shampoo's epsilon is 1e-4; the default 1e-12, which scales
    the null space of the head's rank-3 right statistic by 1000, is swept there."""
    return config_from_dict(
        {
            "model": tiny_model(),
            "data": {"micro_batch_size": 2},
            "pipeline": pipeline(schedule, data_parallel=data_parallel),
            "optimizer": {"name": "shampoo", "lr": 0.01, "momentum": 0.9, "clip_norm": 1.0, "eps": 1e-3},
            "shampoo": {"refresh_steps": 2, "placement": placement, "epsilon": 1e-4, "block_size": 12, **shampoo},
            "run": {"steps": 5, "timeout": 30, "master_port": 0, "in_order": True},
        }
    )


@pytest.mark.parametrize("placement", ["packed", "after-step"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_shampoo_on_the_pipeline_equals_the_reference(schedule, placement):
    reference = assert_equal_to_reference(shampoo_config(schedule, placement), PARAMETER_ATOL)
    grafted_only = train_reference(shampoo_config(schedule, placement, start_step=100))
    assert reference.losses[3:] != pytest.approx(grafted_only.losses[3:], rel=1e-4), (
        "Shampoo's roots changed the updates"
    )


@pytest.mark.slow
@pytest.mark.parametrize("schedule", dealt(3, 4))
def test_shampoo_with_data_parallel_replicas_equals_the_reference(schedule):
    """The captured gradient is synced over every replica of a stage (pipes x data-parallel);
    after-step placement computes the same bit for bit (below). One schedule here, a quarter in
    test_pipefisher.py's copy of this test; test_curvature_equivalence.py's pairs give every
    schedule two copies."""
    assert_equal_to_reference(shampoo_config(schedule, "packed", data_parallel=2), PARAMETER_ATOL)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", dealt(0, 4))
def test_packed_and_after_step_shampoo_are_bitwise_identical(schedule):
    """Placement changes when statistics and roots run, never what they compute. A quarter of
    the schedules here, half in test_pipefisher.py's copy of this test."""
    runs = {}
    for placement in ("packed", "after-step"):
        config = shampoo_config(schedule, placement, grafting="sgd", root="newton", beta2=0.9)
        runs[placement] = run_group(pipelined, config.world_size, args=(config,), timeout=30, deadline=180)[0]
    packed, after_step = runs["packed"], runs["after-step"]
    assert packed.losses == after_step.losses
    assert all(torch.equal(value, after_step.parameters[key]) for key, value in packed.parameters.items())


def test_shampoo_without_root_splitting_in_bf16_equals_the_reference():
    config = shampoo_config("chimera", "packed", split=False).with_overrides(run={"precision": "bf16"})
    assert_equal_to_reference(config, PARAMETER_ATOL)


def test_shampoo_resumes_mid_cycle_bit_for_bit_with_collectives_in_flight(tmp_path):
    """Chimera syncs the captured gradient and exchanges roots between its pipes: a run stopped
    after step 4 (inside the second cycle of 3: captured gradients, new statistics and pending
    roots in the checkpoint) and resumed equals the uninterrupted run."""
    config = shampoo_config("chimera", "packed", refresh_steps=3).with_overrides(run={"steps": 6})
    assert_resumes_bit_for_bit(config, 4, tmp_path)


def test_profile_of_a_shampoo_run_times_its_tasks_and_packs(tmp_path):
    profile, profile_path = profiled_by_the_cli(TINY, tmp_path, "shampoo")
    assert profile.method == "shampoo"
    layers = [layer for stage in profile.stages for layer in stage.layers]
    assert "embed.weight" in [layer.name for layer in profile.stages[0].layers]
    assert all(
        layer.time("refresh", 0) > 0 and layer.time("refresh", 1) > 0 and layer.time("curvature", 0) == 0
        for layer in layers
    )
    packed = subprocess.run(
        ["pipefisher", "pack", "--profile", str(profile_path), "--schedule", "1f1b", "-D", "2", "-N", "4", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert packed.returncode == 0, packed.stderr
    report = json.loads(packed.stdout)
    assert report["refresh_steps"] >= 1 and report["method"] == "shampoo"
    run = subprocess.run(
        [
            "pipefisher",
            "run",
            str(TINY),
            "--optimizer",
            "shampoo",
            "--profile",
            str(profile_path),
            "--steps",
            "3",
            "--json",
            "--master-port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stderr
    assert "Shampoo packed: refresh every" in run.stderr
    steps = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(steps) == 3 and all(step["loss"] > 0 for step in steps)
    kfac = subprocess.run(
        ["pipefisher", "run", str(TINY), "--optimizer", "kfac", "--profile", str(profile_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert kfac.returncode == 2 and "times shampoo tasks but this run uses kfac" in kfac.stderr
    assert "Traceback" not in kfac.stderr


def test_cli_reference_needs_a_refresh_interval_and_runs_with_one():
    base = ["pipefisher", "run", str(TINY), "--optimizer", "shampoo", "--reference", "--steps", "2", "--json"]
    refused = subprocess.run(base, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--shampoo-refresh-steps" in refused.stderr and "Traceback" not in refused.stderr
    ran = subprocess.run(base + ["--shampoo-refresh-steps", "1"], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert [json.loads(line)["step"] for line in ran.stdout.splitlines()] == [1, 2]
