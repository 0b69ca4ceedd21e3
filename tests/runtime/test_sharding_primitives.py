"""`pipefisher.runtime.primitives.sharding` on real gloo ranks: a gradient sharded as FSDP2 shards
it (dim 0, uneven rows) reads back whole, a whole value written back leaves each rank its rows,
and plain tensors pass through untouched (the unsharded runs' path)."""

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from pipefisher.runtime.primitives.sharding import set_gradient, shard_rows, whole_gradient
from pipefisher.runtime.training.launch import run_group


def sharded_round_trip(rank: int, world: int) -> tuple[bool, bool, tuple[int, int], bool]:
    """(whole gradient read back exactly, written value's rows kept locally, this rank's rows,
    the parameter's values untouched)."""
    mesh = init_device_mesh("cpu", (world,))
    whole = torch.arange(15.0).reshape(5, 3)  # 5 rows over 2 ranks: 3 + 2
    parameter = torch.nn.Parameter(distribute_tensor(torch.ones(5, 3), mesh, [Shard(0)]))
    parameter.grad = distribute_tensor(whole, mesh, [Shard(0)])
    read = whole_gradient(parameter)
    new = -2 * read
    set_gradient(parameter, new)
    rows = shard_rows(parameter)
    return (
        torch.equal(read, whole),
        torch.equal(parameter.grad.to_local(), new[rows]),
        (rows.start, rows.stop),
        torch.equal(parameter.to_local(), torch.ones(rows.stop - rows.start, 3)),
    )


def test_a_sharded_gradient_reads_whole_and_writes_back_each_ranks_rows():
    results = run_group(sharded_round_trip, 2, timeout=20, deadline=60)
    assert [result[2] for result in results] == [(0, 3), (3, 5)]
    assert all(read and kept and untouched for read, kept, _, untouched in results)


def test_a_plain_gradient_is_read_and_written_in_place():
    parameter = torch.nn.Parameter(torch.zeros(4, 2))
    parameter.grad = torch.ones(4, 2)
    read = whole_gradient(parameter)
    assert read is parameter.grad
    read.mul_(3)
    set_gradient(parameter, read)  # the gradient itself: nothing to copy
    assert torch.equal(parameter.grad, torch.full((4, 2), 3.0))
    set_gradient(parameter, torch.full((4, 2), 5.0))
    assert torch.equal(parameter.grad, torch.full((4, 2), 5.0))
    assert shard_rows(parameter) == slice(0, 4)
    assert whole_gradient(torch.nn.Parameter(torch.zeros(2))) is None
