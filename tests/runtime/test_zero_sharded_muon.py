"""Muon under ZeRO-2/3 (FSDP2): every replica of a stage gathers each matrix's reduced gradient
whole after the stage's last backward, orthogonalises it and keeps its own rows of the update
(`pipefisher.methods.muon.runtime`); the run equals the single-process reference, and ZeRO-1
stays refused."""

import pytest
from _workers import assert_resumes_bit_for_bit, unit_profile
from _zero_runs import assert_sharded_equals_reference, zero_config

from pipefisher.config import ConfigError
from pipefisher.runtime.training.assembly import build_schedule

pytestmark = pytest.mark.dist


def profiled(config, folder):
    """`config` packing from a made-up profile of its model chunks, saved in `folder` (the
    profiler's gradient-dropping steps do not run sharded)."""
    path = folder / "profile.yaml"
    unit_profile(config, build_schedule(config).num_stages).save(path)
    return config.with_overrides(muon={"profile": str(path)})


def muon_config(schedule, zero):
    """2 stages x 2 replicas, in-order mode, Muon at lr 0.02 with weight decay and clipping, 4 steps."""
    return zero_config(schedule, zero, "muon", 2, optimizer={"lr": 0.02, "weight_decay": 0.1}, run={"steps": 4})


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "zero"), [("1f1b", 3), ("gpipe", 2)])
def test_sharded_muon_equals_the_reference(schedule, zero, tmp_path):
    """Losses and parameters as the single-process reference's (test_muon_pipeline.py's
    tolerances): the update of a matrix is Muon's, orthogonalised from the whole reduced gradient."""
    results = assert_sharded_equals_reference(profiled(muon_config(schedule, zero), tmp_path), rtol=1e-4)
    assert all(record["grad_norm"] > 0 for _, records in results for record in records)


def test_muon_runs_under_zero_2_and_3_and_refuses_zero_1_in_one_line():
    for zero in (2, 3):
        assert muon_config("1f1b", zero).gradient_path.fsdp
    with pytest.raises(ConfigError, match=r"^optimizer.zero: muon .*use optimizer.zero 0, 2 or 3$") as error:
        muon_config("1f1b", 1)
    assert "\n" not in str(error.value)


@pytest.mark.slow
def test_sharded_muon_resumes_bit_for_bit(tmp_path):
    """The momentum every replica holds whole is checkpointed and restored with the sharded
    parameters: a run stopped after 2 steps and resumed ends as the straight run, bit for bit."""
    config = profiled(muon_config("1f1b", 3), tmp_path)
    assert_resumes_bit_for_bit(config, 2, tmp_path)
