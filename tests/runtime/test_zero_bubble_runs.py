"""Zero-bubble schedules (backward split into input gradient B and weight gradient W) train
exactly like the single-process reference: first-order and K-FAC, 2 and 4 stages, real
gloo ranks held to NCCL's in-order rule (`run.in_order`)."""

import subprocess

import pytest
import yaml

from _workers import assert_equal_to_reference
from builders import tiny_model, rules_of
from pipefisher.config import config_from_dict
from pipefisher.core.profile import load_profile
from pipefisher.schedules import SCHEDULES, chunks_per_rank
from sweeps import splits_backward

pytestmark = pytest.mark.dist

#: as in test_pipefisher.py: damped inverses amplify last-bit differences (Shampoo on these
#: schedules: test_curvature_equivalence.py and test_shampoo_pipeline.py)
KFAC_ATOL = 2e-4


def zb_config(schedule, ranks, optimizer="sgd", layers=4, data_parallel=1, **sections):
    """`ranks` pipeline ranks (V-shaped schedules cut the model into 2 × ranks stages), 4
    micro-batches of 2 per rank, in-order mode."""
    settings = {"refresh_steps": 2, "placement": "packed"}
    method = (
        {optimizer: {**settings, **({"factor_decay": 0.5, "damping": 0.01} if optimizer == "kfac" else {})}}
        if optimizer in ("kfac", "shampoo")
        else {}
    )
    return config_from_dict(
        {
            "model": tiny_model(layers=layers),
            "data": {"micro_batch_size": 2},
            "pipeline": {
                "stages": ranks,
                "micro_batches": 4 * ranks,
                "schedule": schedule,
                "data_parallel": data_parallel,
            },
            "optimizer": {"name": optimizer, "lr": 0.05, **({"momentum": 0.9} if optimizer != "sgd" else {})},
            **method,
            "run": {"steps": 4, "timeout": 30, "master_port": 0, "in_order": True},
            **sections,
        }
    )


def stages_of(schedule, ranks):
    return ranks * chunks_per_rank(schedule)


#: every registered schedule that splits the backward, on 1 and 2 ranks where that cuts the
#: 4-block model into 2 or 4 stages (ZB-H1 on 2 ranks; ZB-V and DualPipeV on 1 and 2)
ZERO_BUBBLE_RUNS = [
    (name, ranks) for name in SCHEDULES if splits_backward(name) for ranks in (1, 2) if stages_of(name, ranks) in (2, 4)
]


@pytest.mark.parametrize("schedule,ranks", ZERO_BUBBLE_RUNS)
def test_first_order_equals_the_reference(schedule, ranks):
    assert stages_of(schedule, ranks) in (2, 4)
    assert_equal_to_reference(zb_config(schedule, ranks), parameter_atol=1e-7)


@pytest.mark.parametrize("schedule,ranks", ZERO_BUBBLE_RUNS)
def test_kfac_packed_equals_the_reference(schedule, ranks):
    assert_equal_to_reference(zb_config(schedule, ranks, "kfac"), KFAC_ATOL)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "kfac"])
def test_zb_h1_on_four_stages_equals_the_reference(optimizer):
    assert_equal_to_reference(zb_config("zb-h1", 4, optimizer), 1e-7 if optimizer == "sgd" else KFAC_ATOL)


@pytest.mark.slow
def test_zbv_with_two_data_parallel_copies_and_zero1_equals_the_reference():
    # Adam's eps 1e-3 as in test_zero.py: the attention key biases' gradients are rounding noise
    config = zb_config("zbv", 2, "adamw", data_parallel=2).with_overrides(optimizer={"zero": 1, "eps": 1e-3})
    assert_equal_to_reference(config, parameter_atol=1e-7)


def test_the_profiler_measures_the_weight_gradient_apart(tmp_path):
    """A profile measured on a zero-bubble schedule holds each stage's W time (`weight`), the
    part of its backward that W ran; the first stage, without a differentiable input, runs its
    whole backward at B."""
    run_file, profile_path = tmp_path / "zb.yaml", tmp_path / "zb-profile.yaml"
    config = zb_config("zb-h1", 2)
    run_file.write_text(
        yaml.safe_dump(
            {
                "model": tiny_model(),
                "data": {"micro_batch_size": 2},
                "pipeline": {"stages": 2, "micro_batches": config.pipeline.micro_batches, "schedule": "zb-h1"},
                "optimizer": {"name": "sgd", "lr": 0.05},
                "run": {"steps": 1, "timeout": 30, "master_port": 0},
            }
        )
    )
    result = subprocess.run(
        ["pipefisher", "profile", str(run_file), "-o", str(profile_path), "--master-port", "0", "--repeats", "2"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    first, last = load_profile(profile_path).stages
    assert 0 < last.weight < last.backward, "the last stage's W is part of its backward"
    assert first.weight < 0.2 * first.backward, "the first stage's W has nothing left to do"


def test_kfac_with_weight_gradients_moved_by_the_packer_equals_the_reference(tmp_path):
    """ZBV on 2 ranks with stage 0 (rank 0) twice as slow in the profile: rank 1 waits for it
    between its B ops, and the packer pulls W ops into those waits (`fill, weight gradients
    first`). The run executes that plan, W ops away from where the schedule put them, and still
    trains like the reference."""
    from dataclasses import replace

    from _workers import unit_profile
    from pipefisher.planning.packing.pack import pack
    from pipefisher.planning.plan import moved_weights
    from pipefisher.runtime.training.assembly import build_schedule
    from pipefisher.runtime.training.pipefisher_run import make_plan, pack_options

    config = zb_config("zbv", 2, "kfac").with_overrides(kfac={"profile": str(tmp_path / "profile.yaml")})
    schedule = build_schedule(config)
    profile = unit_profile(config, schedule.num_stages, inverse=1.0)
    profile = replace(profile, stages=(replace(profile.stages[0], forward=2.0, backward=4.0),) + profile.stages[1:])
    profile.save(tmp_path / "profile.yaml")
    assert pack(schedule, profile, rules_of(profile), pack_options(config)).moved_weights > 0, (
        "the case this test is about"
    )
    assert sum(moved_weights(make_plan(config, schedule, profile).plan)) > 0, "the plan the run uses moves W ops"
    assert_equal_to_reference(config, KFAC_ATOL)
