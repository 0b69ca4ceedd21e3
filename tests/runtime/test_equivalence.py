"""Every schedule trains exactly like the single-process reference (real gloo ranks, held to
NCCL's in-order rule by the test configuration's `run.in_order`)."""

import pytest
import torch

from _workers import pipelined
from pipefisher.runtime.training.launch import run_group
from pipefisher.runtime.training.reference import train_reference
from pipefisher.schedules import SCHEDULES
from sweeps import pipeline

pytestmark = pytest.mark.dist


def assert_same_training(config, results, reference):
    seen = set()
    for result in results:
        torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(reference.losses), rtol=1e-5, atol=0)
        for key, value in result.parameters.items():
            name = key.split(".", 1)[1] if key.startswith("p1.") else key  # Chimera's second copy
            torch.testing.assert_close(value, reference.parameters[name], rtol=1e-5, atol=1e-7)
            seen.add(name)
    assert seen == set(reference.parameters), "every parameter lives on some rank"
    assert reference.losses[-1] < reference.losses[0]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_two_ranks_equal_the_reference(schedule, tiny_config):
    config = tiny_config(**pipeline(schedule))
    results = run_group(pipelined, config.world_size, args=(config,), timeout=20, deadline=120)
    assert_same_training(config, results, train_reference(config))


def test_adamw_and_more_micro_batches_equal_the_reference(tiny_config):
    config = tiny_config(schedule="1f1b", micro_batches=6).with_overrides(optimizer={"name": "adamw", "lr": 0.01})
    results = run_group(pipelined, config.world_size, args=(config,), timeout=20, deadline=120)
    assert_same_training(config, results, train_reference(config))


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_data_parallel_2x2_equals_the_reference(schedule, tiny_config):
    config = tiny_config(**pipeline(schedule, data_parallel=2))
    assert config.world_size == 4
    results = run_group(pipelined, 4, args=(config,), timeout=30, deadline=180)
    assert_same_training(config, results, train_reference(config))


def test_every_split_trains_the_same_model_from_one_seed(tiny_config):
    """Parameters come from (seed, global name): 2 stages, 2 x 2 chunks and 4 stages of the same
    4-block model start equal and train to the same losses and parameters."""
    splits = {
        "1f1b, 2 stages": tiny_config(schedule="1f1b"),
        "interleaved, 2 x 2 chunks": tiny_config(schedule="interleaved", chunks=2),
        "gpipe, 4 stages": tiny_config(schedule="gpipe", stages=4),
    }
    runs = {name: train_reference(config) for name, config in splits.items()}
    by_name = {
        name: {key.split(".", 1)[1]: value for key, value in run.parameters.items()} for name, run in runs.items()
    }
    first = next(iter(runs))
    for name, run in runs.items():
        torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(runs[first].losses), rtol=1e-6, atol=0)
        assert by_name[name].keys() == by_name[first].keys()
        for key, value in by_name[name].items():
            torch.testing.assert_close(value, by_name[first][key], rtol=1e-6, atol=1e-7)
