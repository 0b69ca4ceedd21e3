"""Shampoo and SOAP under ZeRO-2/3 (PyTorch's FSDP2 over each stage's replicas): the parameters,
gradients and first-order state are sharded, each method's own state stays whole on every
replica (gather, precondition, keep this rank's rows); trained on 2 stages x 2 replicas in the
in-order mode, they equal the single-process reference."""

import pytest
from _workers import assert_resumes_bit_for_bit, unit_profile
from _zero_runs import assert_sharded_equals_reference, zero_config

from pipefisher.runtime.training.assembly import build_schedule

pytestmark = pytest.mark.dist

#: the sections and parameter tolerances of the pipeline tests (test_shampoo_pipeline.py,
#: test_soap_pipeline.py)
SECTIONS = {
    "shampoo": ({"refresh_steps": 2, "block_size": 12, "epsilon": 1e-4}, 1e-6),
    "soap": ({"refresh_steps": 2, "epsilon": 1e-3}, 1e-5),
}
#: steps until the first refreshed roots (Shampoo: from step 3) or bases (SOAP: step 5) are in use
STEPS = {"shampoo": 4, "soap": 5}


def sharded_run(method, schedule, zero, folder):
    """2 stages x 2 replicas (`zero_config`) with the method's section and a made-up profile
    (`unit_profile`, saved in `folder`): measuring one drops a step's gradients, which ZeRO-2/3
    does not run. Shampoo's SGD takes momentum 0.9 as in test_shampoo_pipeline.py (without it
    torch's SGD is fused, which has no DTensor rule)."""
    section, _ = SECTIONS[method]
    profile = folder / "profile.yaml"
    config = zero_config(schedule, zero, method).with_overrides(
        optimizer={"momentum": 0.9}, run={"steps": STEPS[method]}, **{method: {**section, "profile": str(profile)}}
    )
    unit_profile(config, build_schedule(config).num_stages).save(profile)
    return config


@pytest.mark.parametrize(
    ("method", "schedule", "zero"),
    [
        pytest.param("shampoo", "1f1b", 3, marks=pytest.mark.slow),
        ("soap", "1f1b", 2),
        ("shampoo", "interleaved", 2),
        ("soap", "interleaved", 3),
    ],
)
def test_sharded_shampoo_and_soap_equal_the_reference(method, schedule, zero, tmp_path):
    """Interleaved: each rank holds two stages, so two engines gather on two communicators."""
    _, atol = SECTIONS[method]
    assert_sharded_equals_reference(sharded_run(method, schedule, zero, tmp_path), atol=atol)


@pytest.mark.slow
def test_sharded_shampoo_resumes_mid_cycle_bit_for_bit(tmp_path):
    """Its state is saved whole as unsharded, the parameters gathered; stopped mid-cycle (after
    step 3, the second cycle's first), it resumes into the straight run's losses and parameters
    bit for bit."""
    assert_resumes_bit_for_bit(
        sharded_run("shampoo", "1f1b", 3, tmp_path).with_overrides(run={"steps": 5}), 3, tmp_path
    )
