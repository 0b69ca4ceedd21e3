"""K-FAC-reduce (`kfac.approximation: reduce`, one factor row per sequence) pipelined equals its
single-process reference: on 1F1B, on Chimera (two pipes, each with half the batch's sequences)
and split over two tensor-parallel processes with two data-parallel copies (the shared part's
rows, here sequences, divided between the shards); and it is not expand under another name."""

import pytest
import torch

from pipefisher.runtime.training.reference import train_reference
from pipefisher.testing import assert_equal_to_reference
from test_curvature_equivalence import PARAMETER_ATOL, shipped_defaults
from test_tensor_parallel import tensor_parallel

pytestmark = pytest.mark.dist

REDUCE = {"approximation": "reduce"}


@pytest.mark.parametrize("schedule", ["1f1b", "chimera"])
def test_reduce_equals_the_reference(schedule):
    assert_equal_to_reference(shipped_defaults("kfac", schedule, **REDUCE), PARAMETER_ATOL)


@pytest.mark.slow
def test_reduce_with_tensor_and_data_parallel_equals_the_reference():
    assert_equal_to_reference(tensor_parallel("kfac", "1f1b", data_parallel=2, **REDUCE), PARAMETER_ATOL)


def test_reduce_takes_other_steps_than_expand():
    """From step 3 on (the inverses of step 0 in use from step 2), the losses part."""
    expand = train_reference(shipped_defaults("kfac", "1f1b")).losses
    reduce = train_reference(shipped_defaults("kfac", "1f1b", **REDUCE)).losses
    assert expand[:3] == pytest.approx(reduce[:3], rel=1e-6)
    assert not torch.allclose(torch.tensor(expand[3:]), torch.tensor(reduce[3:]), rtol=1e-4, atol=0)
