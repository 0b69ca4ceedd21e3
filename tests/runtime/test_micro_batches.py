"""The executor builds each micro-batch once per rank and step, and moves to the device only the
tensors its stages read."""

import pytest
import torch

from _workers import counting_batches
from pipefisher.runtime.pipeline.batches import DeviceBatch
from pipefisher.runtime.training.launch import run_group


def test_a_device_batch_moves_what_is_read_once():
    host = {"input_ids": torch.arange(6).reshape(2, 3), "labels": torch.ones(2, 3)}
    batch = DeviceBatch(host, torch.device("cpu"))
    assert list(batch) == ["input_ids", "labels"] and len(batch) == 2 and batch.moved == {}
    first = batch["labels"]
    assert batch["labels"] is first and list(batch.moved) == ["labels"]
    assert torch.equal(first, host["labels"])


@pytest.mark.dist
def test_interleaved_ranks_build_each_micro_batch_once_and_move_only_what_they_read(tiny_config):
    """Interleaved: each rank holds 2 chunks, so runs 2 forwards of every micro-batch."""
    config = tiny_config(schedule="interleaved")
    results = run_group(counting_batches, config.world_size, args=(config,), timeout=20, deadline=120)
    every = {(step, mb) for step in range(config.run.steps) for mb in range(config.pipeline.micro_batches)}
    for built, _ in results:
        assert set(built) == every and set(built.values()) == {1}
    (_, first_rank), (_, second_rank) = results
    # rank 0 holds chunks 0 and 2 (the embedding reads the inputs), rank 1 chunks 1 and 3 (the loss reads the targets)
    assert set(map(tuple, first_rank.values())) == {("inputs",)}
    assert set(map(tuple, second_rank.values())) == {("targets",)}
