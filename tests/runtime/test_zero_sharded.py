"""ZeRO-2/3 on the pipeline (PyTorch's FSDP2 over each stage's replicas): trains like the
single-process reference under the in-order communication mode, with FSDP's collectives in the
replayed plan; what it does not run yet is refused in one line; checkpoints resume across ZeRO
degrees."""

import pytest
import torch
from _workers import checkpointing, pipelined_with_records
from builders import tiny_model

from pipefisher.config import ConfigError, config_from_dict
from pipefisher.core.topology import Topology
from pipefisher.planning.comm.actions import ActionKind, CollectiveKind
from pipefisher.planning.comm.plan import plan_actions
from pipefisher.planning.comm.replay import replay
from pipefisher.runtime.pipeline.plan_runner import schedule_plan
from pipefisher.runtime.training.launch import run_group
from pipefisher.runtime.training.reference import train_reference
from pipefisher.runtime.training.resumption import resumable_step
from pipefisher.schedules import SCHEDULES, chunks_per_rank, get_schedule


def sharded_config(schedule, zero, stages=1, optimizer="adamw", **overrides):
    """`stages` stages x 2 replicas, in-order mode; Adam's eps 1e-3 as tests/runtime/test_zero.py
    says why."""
    return config_from_dict(
        {
            "model": tiny_model(),
            "data": {"micro_batch_size": 2},
            "pipeline": {"stages": stages, "micro_batches": 4, "schedule": schedule, "data_parallel": 2},
            "optimizer": {
                "name": optimizer,
                "lr": 0.01,
                "eps": 1e-3,
                "clip_norm": 0.5,
                "weight_decay": 0.01,
                "zero": zero,
            },
            "run": {"steps": 3, "timeout": 30, "master_port": 0, "in_order": True},
        }
    ).with_overrides(**overrides)


def train(config):
    return run_group(pipelined_with_records, config.world_size, args=(config,), timeout=30, deadline=240)


def assert_matches_reference(config):
    reference = train_reference(config.with_overrides(optimizer={"zero": 0}))
    for result, records in train(config):
        torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(reference.losses), rtol=1e-5, atol=0)
        assert set(result.parameters) == set(reference.parameters)
        for key, value in result.parameters.items():
            torch.testing.assert_close(value, reference.parameters[key], rtol=1e-5, atol=1e-6, msg=key)
        assert all(record["grad_norm"] > 0 for record in records)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("zero", [2, 3])
def test_sharded_adamw_equals_the_reference(schedule, zero):
    assert_matches_reference(sharded_config(schedule, zero))


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved"])
def test_sharded_two_stages_equal_the_reference(schedule):
    assert_matches_reference(sharded_config(schedule, 3, stages=2))


@pytest.mark.slow
def test_sharded_sgd_with_momentum_equals_the_reference():
    assert_matches_reference(sharded_config("1f1b", 2, optimizer="sgd", optimizer_momentum=None))
