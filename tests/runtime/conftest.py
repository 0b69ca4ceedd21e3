import pytest

from builders import tiny_model
from pipefisher.config import RunConfig, config_from_dict


@pytest.fixture
def tiny_config():
    """A small run: 4-block Transformer, 2 stages, 4 micro-batches of 2, 3 steps, 20 s timeout."""

    def make(**pipeline) -> RunConfig:
        return config_from_dict(
            {
                "model": tiny_model(),
                "data": {"micro_batch_size": 2},
                "pipeline": {"stages": 2, "micro_batches": 4, **pipeline},
                "optimizer": {"name": "sgd", "lr": 0.1},
                "run": {"steps": 3, "timeout": 20, "master_port": 0, "in_order": True},
            }
        )

    return make


@pytest.fixture(autouse=True)
def _one_thread():
    """The reference runs in this process with one thread, like every rank."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
