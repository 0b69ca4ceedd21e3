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


def reference_name(key):
    """A parameter's name in the reference (a second pipe's copy, ``p1.…``, as pipe 0's)."""
    return key.split(".", 1)[1] if key.startswith("p1.") else key


def assert_sharded_equals_reference(config, rtol=1e-5, atol=1e-6):
    """Every rank of `config` trains as the single-process reference of its unsharded twin
    (optimizer.zero 0): the same parameters, losses to `rtol`, parameters to `rtol` and `atol`;
    returns every rank's (TrainResult, step records)."""
    import torch

    from pipefisher.runtime.training.reference import train_reference

    reference = train_reference(config.with_overrides(optimizer={"zero": 0}))
    results = train(config)
    assert {reference_name(key) for result, _ in results for key in result.parameters} == set(reference.parameters)
    for result, _ in results:
        torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(reference.losses), rtol=rtol, atol=0)
        for key, value in result.parameters.items():
            torch.testing.assert_close(value, reference.parameters[reference_name(key)], rtol=rtol, atol=atol, msg=key)
    return results
