"""PowerSGD on the pipeline's data-parallel dimension: the compression matches torch's own
powerSGD_hook, is exact at the gradients' rank, cuts the bytes by the expected factor, starts at
its start step, and resumes bit for bit."""

import subprocess
from pathlib import Path

import pytest
import torch
from _workers import assert_resumes_bit_for_bit, pipelined_with_records, powersgd_against_torch

from pipefisher.config import ConfigError, config_from_dict
from pipefisher.planning.comm.volume import powersgd_elements
from pipefisher.runtime.training.launch import run_group

ROOT = Path(__file__).resolve().parents[2]


def powersgd_config(schedule, rank, **overrides):
    """2 stages x 2 replicas, in-order mode; one token row per micro-batch position and 2 of 2
    positions per replica: every summed weight gradient has rank <= 8 < the layers' widths."""
    return config_from_dict(
        {
            "model": {"layers": 4, "hidden": 32, "heads": 2, "ffn": 64, "seq_len": 2, "input_dim": 8, "output_dim": 3},
            "data": {"micro_batch_size": 1},
            "pipeline": {"stages": 2, "micro_batches": 2, "schedule": schedule, "data_parallel": 2},
            "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9, "clip_norm": 0.5},
            "comm": {"powersgd_rank": rank},
            "run": {"steps": 4, "timeout": 30, "master_port": 0, "in_order": True},
        }
    ).with_overrides(**overrides)


def train(config):
    return run_group(pipelined_with_records, config.world_size, args=(config,), timeout=30, deadline=240)


def expected_bytes(parameters: dict, replicas: int, rank: int, stages: set[int]) -> int:
    """Ring all-reduce bytes per step of the stages a rank holds: P and Q factors of the matrices
    PowerSGD compresses, everything else whole (fp32)."""
    elements = sum(
        powersgd_elements(tuple(value.shape), rank)
        for key, value in parameters.items()
        if int(key.split(".")[0]) in stages
    )
    return 2 * (replicas - 1) * 4 * elements // replicas


@pytest.mark.parametrize("rank", [1, 4])
def test_the_compression_matches_torchs_powersgd_hook(rank):
    """Seven steps on two gloo ranks (two uncompressed, then PowerSGD with error feedback and a
    warm start), pipefisher's sums against torch's means x 2."""
    for ours, theirs in run_group(powersgd_against_torch, 2, args=(rank, 7), timeout=30, deadline=60)[0]:
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("schedule", ["chimera"])
def test_rank_at_the_gradients_rank_equals_uncompressed_training_and_sends_less(schedule):
    uncompressed, exact, lossy = (
        train(powersgd_config(schedule, 0)),
        train(powersgd_config(schedule, 8)),
        train(powersgd_config(schedule, 2, comm={"powersgd_start_step": 1})),
    )
    for (plain, plain_records), (compressed, records) in zip(uncompressed, exact):
        torch.testing.assert_close(torch.tensor(compressed.losses), torch.tensor(plain.losses), rtol=1e-5, atol=0)
        for key, value in compressed.parameters.items():
            torch.testing.assert_close(value, plain.parameters[key], rtol=1e-5, atol=1e-6)
    (plain, plain_records), (compressed, records), (low, low_records) = uncompressed[0], exact[0], lossy[0]
    assert low.losses[:2] == plain.losses[:2], "before its start step PowerSGD does not compress"
    assert max(abs(a - b) for a, b in zip(low.losses[2:], plain.losses[2:])) > 1e-4, (
        "rank 2 is below the gradients' rank"
    )
    assert low_records[0]["grad_comm_bytes"] == plain_records[0]["grad_comm_bytes"] > low_records[1]["grad_comm_bytes"]
    if schedule == "1f1b":  # rank 0 holds stage 0 of 2 replicas
        assert plain_records[0]["grad_comm_bytes"] == expected_bytes(plain.parameters, 2, 0, {0})
        assert records[0]["grad_comm_bytes"] == expected_bytes(plain.parameters, 2, 8, {0})
        assert low_records[1]["grad_comm_bytes"] == expected_bytes(plain.parameters, 2, 2, {0})


@pytest.mark.slow
def test_powersgd_at_the_gradients_rank_under_kfac_equals_uncompressed():
    """K-FAC preconditions before the reduction; the profile measured before training times
    PowerSGD's reduction and leaves its state as it was."""
    sections = {"optimizer": {"name": "kfac"}, "kfac": {"refresh_steps": 2, "factor_decay": 0.5, "damping": 0.01}}
    for (plain, _), (compressed, _) in zip(
        train(powersgd_config("chimera", 0, **sections)), train(powersgd_config("chimera", 8, **sections))
    ):
        torch.testing.assert_close(torch.tensor(compressed.losses), torch.tensor(plain.losses), rtol=1e-5, atol=0)
        for key, value in compressed.parameters.items():
            torch.testing.assert_close(value, plain.parameters[key], rtol=1e-5, atol=1e-5)


def test_fp16_loss_scales_leave_the_compression_unchanged_and_an_overflow_clears_the_error():
    """One replica (the all-reduces are identities): gradients scaled by a changing loss scale
    give the scaled result of the unscaled gradients, because errors are kept unscaled; an
    overflowing step leaves no inf or NaN in the carried error or the warm-start Q."""
    from torch import nn

    from pipefisher.runtime.gradient_path.buffers import GradientBuffer
    from pipefisher.runtime.gradient_path.powersgd import PowerSGD

    def compressor(scale):
        buffer = GradientBuffer(nn.Sequential(nn.Linear(24, 40), nn.Linear(40, 16)), bucket_bytes=1 << 30)
        return buffer, PowerSGD(buffer, 2, seed=3, loss_scale=scale)

    scale = torch.ones(1)
    (plain_buffer, plain), (scaled_buffer, scaled) = compressor(lambda: None), compressor(lambda: scale)
    for step, value in enumerate([1024.0, 512.0, 2048.0, 2048.0]):
        scale.fill_(value)
        gradient = torch.randn(plain_buffer.flat.numel(), generator=torch.Generator().manual_seed(step))
        plain_buffer.flat.copy_(gradient)
        scaled_buffer.flat.copy_(gradient * value)
        for state in (plain, scaled):
            state.p_factors()
            state.q_factors()
            state.decompress()
        torch.testing.assert_close(scaled_buffer.flat, plain_buffer.flat * value, rtol=1e-5, atol=1e-3)
        assert not torch.equal(plain_buffer.flat, gradient), "rank 2 compresses"
    scaled_buffer.flat.fill_(float("inf"))
    for phase in (scaled.p_factors, scaled.q_factors, scaled.decompress):
        phase()
    assert all(torch.isfinite(error).all() for error in scaled.errors) and torch.isfinite(scaled.q_flat).all()
    scaled_buffer.flat.copy_(torch.randn(scaled_buffer.flat.numel(), generator=torch.Generator().manual_seed(9)))
    for phase in (scaled.p_factors, scaled.q_factors, scaled.decompress):
        phase()
    assert torch.isfinite(scaled_buffer.flat).all(), "the step after an overflow compresses again"


def test_powersgd_resumes_bit_for_bit(tmp_path):
    assert_resumes_bit_for_bit(powersgd_config("1f1b", 2), 2, tmp_path)


def test_bad_powersgd_settings_are_one_line_errors():
    with pytest.raises(ConfigError, match=r"comm.powersgd_rank: -1 must be >= 0"):
        powersgd_config("1f1b", -1)
    with pytest.raises(ConfigError, match="use one of them"):
        powersgd_config("1f1b", 2, optimizer={"zero": 1})
    demo = str(ROOT / "schedules" / "tiny-cpu.yaml")
    for args, needle in (
        (["--powersgd-rank", "2", "--reference"], "--reference trains in one process"),
        (["--powersgd-rank", "x"], "--powersgd-rank"),
    ):
        result = subprocess.run(["pipefisher", "run", demo, *args], capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1 and needle in result.stderr


def test_orthonormalise_spans_what_qr_spans_and_keeps_zero_columns_zero():
    from pipefisher.runtime.gradient_path.powersgd import orthonormalise_

    generator = torch.Generator().manual_seed(0)
    base = torch.randn(64, 4, generator=generator, dtype=torch.float64)
    nearly_dependent = torch.cat(
        [base, base[:, :2] + 1e-6 * torch.randn(64, 2, generator=generator, dtype=torch.float64)], dim=1
    )
    for matrix in (base.float(), nearly_dependent.float()):
        ours = matrix.clone()
        orthonormalise_(ours)
        torch.testing.assert_close(ours.T @ ours, torch.eye(matrix.shape[1]), rtol=0, atol=1e-5)
        basis = torch.linalg.qr(matrix.double()).Q.float()
        torch.testing.assert_close(ours[:, :4] @ ours[:, :4].T, basis[:, :4] @ basis[:, :4].T, rtol=0, atol=1e-5)
    zero = torch.zeros(8, 2)
    orthonormalise_(zero)
    assert zero.eq(0).all()
