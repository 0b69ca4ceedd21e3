"""The run the ZeRO tests share (tests/runtime/test_zero.py, test_zero_sharded.py): a tiny model on
`stages` stages x 2 replicas in the in-order mode, trained on real gloo ranks."""

from _workers import pipelined_with_records
from builders import tiny_model

from pipefisher.config import config_from_dict
from pipefisher.runtime.training.launch import run_group


def zero_config(schedule, zero, rule="adamw", stages=2, **overrides):
    """`rule`: the first-order optimizer; `overrides`: sections for `with_overrides`. Adam's eps is 1e-3: the attention key biases have a zero gradient in exact arithmetic, and a
    small eps would turn the rounding noise of any other summation order into full-size steps."""
    return config_from_dict(
        {
            "model": tiny_model(),
            "data": {"micro_batch_size": 2},
            "pipeline": {"stages": stages, "micro_batches": 4, "schedule": schedule, "data_parallel": 2},
            "optimizer": {
                "name": rule,
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
    """Every rank's (TrainResult, step records)."""
    return run_group(pipelined_with_records, config.world_size, args=(config,), timeout=30, deadline=240)
