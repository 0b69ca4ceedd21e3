"""`world_of_one`: this process as a process group by itself, the environment as it was after."""

import os

import pytest
import torch
import torch.distributed as dist

from pipefisher.runtime.training.launch import world_of_one

pytestmark = pytest.mark.dist

TORCHRUN = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def test_the_group_holds_this_process_alone_and_the_torchrun_variables_are_restored(monkeypatch):
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.7")  # one that was set before keeps its value
    with world_of_one("gloo", torch.device("cpu")):
        assert dist.get_world_size() == 1 and dist.get_rank() == 0
        assert os.environ["RANK"] == "0" and os.environ["MASTER_ADDR"] == "127.0.0.1"
        total = torch.ones(3)
        dist.all_reduce(total)
        assert total.tolist() == [1.0, 1.0, 1.0]
    assert not dist.is_initialized()
    assert os.environ["MASTER_ADDR"] == "10.0.0.7"
    assert not any(name in os.environ for name in TORCHRUN[1:]), (
        "a pipefisher run started next would take itself for a rank"
    )
