"""ZeRO-1 on the pipeline: optimizer state sharded over each stage's replicas trains exactly like
the unsharded run and the single-process reference, holds 1/R of the state per rank, sends the
same gradient bytes, and resumes bit for bit."""

import subprocess
from pathlib import Path

import pytest
import torch
from _workers import assert_equal_to_reference, assert_resumes_bit_for_bit
from _zero_runs import train, zero_config

from pipefisher.config import ConfigError
from pipefisher.core.topology import Topology
from pipefisher.methods.registry import methods
from pipefisher.runtime.gradient_path.buffers import GradientBuffer, Ownership
from pipefisher.runtime.training.resumption import resumable_step, resumption
from pipefisher.runtime.training.reference import train_reference
from pipefisher.schedules import get_schedule

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("schedule", ["1f1b", "chimera"])
def test_zero1_equals_the_unsharded_run_and_the_reference_with_a_fraction_of_the_state(schedule):
    unsharded, sharded = train(zero_config(schedule, 0)), train(zero_config(schedule, 1))
    reference = train_reference(zero_config(schedule, 0))
    for (plain, plain_records), (zero, zero_records) in zip(unsharded, sharded):
        torch.testing.assert_close(torch.tensor(zero.losses), torch.tensor(plain.losses), rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(zero.losses), torch.tensor(reference.losses), rtol=1e-5, atol=0)
        for key, value in zero.parameters.items():
            torch.testing.assert_close(value, plain.parameters[key], rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(
                value,
                reference.parameters[key.split(".", 1)[1] if key.startswith("p1.") else key],
                rtol=1e-5,
                atol=1e-6,
            )
        # same ring volume: reduces to owners + broadcasts from them = one all-reduce
        assert [r["grad_comm_bytes"] for r in zero_records] == [r["grad_comm_bytes"] for r in plain_records]
    replicas = 2 if schedule == "1f1b" else 4  # Chimera's two pipes hold every stage twice per pipeline
    plain_bytes = [ranks["optimizer"] for ranks in unsharded[0][0].state_bytes]
    zero_bytes = [ranks["optimizer"] for ranks in sharded[0][0].state_bytes]
    assert sum(plain_bytes) == replicas * sum(zero_bytes), "every parameter's state lives on exactly one replica"
    assert max(zero_bytes) <= 1.5 * max(plain_bytes) / replicas, (zero_bytes, plain_bytes)
    gradient_bytes = 4 * sum(value.numel() for value in unsharded[0][0].parameters.values())
    expected = 2 * (replicas - 1) * gradient_bytes // replicas if schedule == "1f1b" else None
    if expected is not None:  # 1F1B: rank 0 holds stage 0 only
        assert unsharded[0][1][0]["grad_comm_bytes"] == pytest.approx(expected, abs=8)


def test_zero1_with_lamb_equals_the_unsharded_run_and_the_reference():
    """LAMB's trust ratio needs whole-parameter norms: ZeRO-1 shards by parameter, so the owner has
    them; its multi-tensor step updates each parameter as it would alone: bit for bit unsharded.
    Against the reference, but the attention key biases: their gradient is rounding noise (zero in
    exact arithmetic), which the trust ratio scales to a full step (lr·‖b‖) in the noise's
    direction, and the noise depends on the summation order."""
    unsharded, sharded = train(zero_config("1f1b", 0, "lamb")), train(zero_config("1f1b", 1, "lamb"))
    reference = train_reference(zero_config("1f1b", 0, "lamb"))
    for (plain, _), (zero, _) in zip(unsharded, sharded):
        assert zero.losses == plain.losses
        assert all(torch.equal(value, plain.parameters[key]) for key, value in zero.parameters.items())
        torch.testing.assert_close(torch.tensor(plain.losses), torch.tensor(reference.losses), rtol=1e-5, atol=0)
        for key, value in plain.parameters.items():
            if not key.endswith("attention.key.bias"):
                torch.testing.assert_close(value, reference.parameters[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("method", methods())
def test_zero1_under_a_curvature_method_equals_the_reference(method):
    """K-FAC preconditions before the reduction; Shampoo preconditions (with its grafting state)
    only the parameters a rank owns, after it; Muon shares a replicated stage's work among its
    replicas itself and SOAP folds the reduced gradient on every replica: both refuse ZeRO-1 in
    one line (None)."""
    sections = {
        "kfac": {"refresh_steps": 2, "factor_decay": 0.5, "damping": 0.01},
        "shampoo": {"refresh_steps": 2, "block_size": 12, "epsilon": 1e-4},
        "muon": None,
        "soap": None,
    }
    if sections[method] is None:
        with pytest.raises(ConfigError, match=rf"^optimizer.zero: {method} "):
            zero_config("chimera", 1, method)
        return
    config = zero_config("chimera", 1, method).with_overrides(
        optimizer={"lr": 0.05 if method == "kfac" else 0.01}, run={"steps": 4}, **{method: sections[method]}
    )
    assert_equal_to_reference(config, 2e-4)


def test_zero1_resumes_bit_for_bit_and_unsharded_on_another_layout(tmp_path):
    """ZeRO-1's shards are saved under their parameters' names: a run without ZeRO resumes them
    (the whole check of such resumptions is tests/runtime/test_relayout.py)."""
    config = zero_config("1f1b", 1, run={"steps": 4})
    parted = assert_resumes_bit_for_bit(config, 2, tmp_path)
    unsharded = config.with_overrides(optimizer={"zero": 0})
    assert resumable_step(parted, unsharded)[0] == 4 and not resumption(parted, 4, unsharded).same_layout


def test_a_sharded_buffer_cuts_buckets_at_owners_and_holds_the_parameters():
    from pipefisher.models.tiny import TinyRegression

    config = zero_config("1f1b", 1)
    module = TinyRegression(config.model).build_stage(0, 2, seed=0)
    topology = Topology(get_schedule("1f1b", 2, 4), data_parallel=2)
    ownership = Ownership(topology, 0, {(0, 0): module}, sharded=True)
    owners = ownership.owners[(0, 0)]
    assert sorted(set(owners)) == [0, 2] and owners == sorted(owners)
    before = [p.detach().clone() for p in module.parameters()]
    buffer = GradientBuffer(module, bucket_bytes=1 << 20, owners=owners)
    assert buffer.bucket_owners == [0, 2], "one bucket per owner when buckets are large"
    assert all(torch.equal(p, b) for p, b in zip(module.parameters(), before))
    buffer.parameter_flat.add_(1.0)
    assert all(torch.equal(p, b + 1) for p, b in zip(module.parameters(), before)), (
        "parameters are views of the flat buffer"
    )
    small = GradientBuffer(TinyRegression(config.model).build_stage(0, 2, seed=0), bucket_bytes=1024, owners=owners)
    assert len(small.buckets) > 2 and sorted(set(small.bucket_owners)) == [0, 2]
    assert ownership.counts(next(module.parameters())) and ownership.updates(next(module.parameters()))
    assert not Ownership(topology, 2, {(0, 0): module}, sharded=True).updates(next(module.parameters()))


def test_bad_zero_settings_are_one_line_errors():
    with pytest.raises(
        ConfigError, match=r"optimizer.zero: 4 must be in \[0, 3\] \(0 = off, 1 = the optimizer state sharded"
    ):
        zero_config("1f1b", 4)
    result = subprocess.run(
        ["pipefisher", "run", str(ROOT / "schedules" / "tiny-cpu.yaml"), "--zero", "4"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1 and "--zero" in result.stderr
