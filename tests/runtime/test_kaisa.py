"""K-FAC with gradient workers (KAISA's grad-worker fraction) on the pipeline: equal to the
single-process reference, each layer's inverses on f of a stage's replicas, the preconditioned
gradients' broadcasts counted, and a mid-cycle resume bit for bit."""

import pytest
import torch
from _workers import assert_resumes_bit_for_bit, measured_profile, pipelined_with_records
from test_pipefisher import PARAMETER_ATOL, kfac_config

from pipefisher.methods.kfac import KFACEngine
from pipefisher.models.tiny import TinyRegression
from pipefisher.runtime.training.launch import run_group
from pipefisher.runtime.training.reference import train_reference


def run(schedule, fraction, **overrides):
    config = kfac_config(schedule, "packed", data_parallel=2).with_overrides(
        kfac={"grad_worker_fraction": fraction}, run={"steps": 4}, **overrides
    )
    return config, run_group(pipelined_with_records, config.world_size, args=(config,), timeout=30, deadline=240)


def inverse_and_gradient_bytes(config, stage):
    """Bytes of the stage's K-FAC inverses (fp32 A and B of every layer, each with its one-byte
    validity flag) and of its layers' fp32 gradients."""
    module = TinyRegression(config.model).build_stage(stage, 2, seed=0)
    layers = KFACEngine(module).layers()
    inverses = sum(4 * info.size(factor) ** 2 + 1 for info in layers for factor in "AB")
    names = {info.name for info in layers}
    gradients = sum(4 * p.numel() for name, p in module.named_parameters() if name.rsplit(".", 1)[0] in names)
    return inverses, gradients


def check(schedule, fractions):
    """Every fraction equals the reference; summed over the ranks, K-FAC state at a cycle's end
    falls by (1 - f) of the inverses every replica keeps at f = 1."""
    runs = {fraction: run(schedule, fraction) for fraction in (1.0, *fractions)}
    config = runs[1.0][0]
    reference = train_reference(config)
    for fraction, (_, results) in runs.items():
        for result, _ in results:
            torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(reference.losses), rtol=1e-5, atol=0)
            for key, value in result.parameters.items():
                name = key.split(".", 1)[1] if key.startswith("p1.") else key
                torch.testing.assert_close(value, reference.parameters[name], rtol=1e-5, atol=PARAMETER_ATOL)
    replicas = 2 * (2 if schedule == "chimera" else 1)
    inverses = replicas * sum(inverse_and_gradient_bytes(config, stage)[0] for stage in range(2))
    every = sum(ranks["curvature"] for ranks in runs[1.0][1][0][0].state_bytes)
    for fraction in fractions:
        kept = sum(ranks["curvature"] for ranks in runs[fraction][1][0][0].state_bytes)
        assert every - kept == round((1 - fraction) * inverses), fraction
    return runs


def test_one_worker_of_two_equals_the_reference_and_broadcasts_the_preconditioned_gradients():
    runs = check("1f1b", [0.5])
    config = runs[1.0][0]
    _, gradients = inverse_and_gradient_bytes(config, 0)
    plain, workers = runs[1.0][1][0][1], runs[0.5][1][0][1]  # rank 0: stage 0 of replica 0
    assert all(w["grad_comm_bytes"] - p["grad_comm_bytes"] == gradients // 2 for p, w in zip(plain, workers))


@pytest.mark.slow
def test_chimera_with_a_quarter_and_a_half_of_the_replicas_as_workers_equals_the_reference():
    check("chimera", [0.25, 0.5])


def test_gradient_workers_resume_mid_cycle_bit_for_bit(tmp_path):
    """Chimera with one worker per layer: the exchange's source forgets an inverse once sent, and
    a checkpoint between steps keeps what is still in flight."""
    sections = {"kfac": {"refresh_steps": 3, "grad_worker_fraction": 0.25}, "run": {"steps": 6}}
    assert_resumes_bit_for_bit(
        kfac_config("chimera", "packed", data_parallel=2).with_overrides(**sections), 4, tmp_path
    )


def test_a_profile_with_gradient_workers_times_their_share_in_the_step_end():
    """With gradient workers there is no P op: each worker preconditions its layers in the step
    end, whose share the profile measures (`method_step_end`); with every replica a worker, it
    measures none."""
    for fraction, expected in ((0.5, True), (1.0, False)):
        config = kfac_config("1f1b", "packed", data_parallel=2).with_overrides(kfac={"grad_worker_fraction": fraction})
        profile = run_group(measured_profile, config.world_size, args=(config,), timeout=30, deadline=120)[0]
        assert ["method_step_end" in stage.samples for stage in profile.stages] == [expected] * 2, fraction
        assert all(stage.method_step_end <= stage.step_end for stage in profile.stages)
