"""Whole and sharded tensors under ZeRO-2/3 (PyTorch's FSDP2 `DTensor`s) for every layer above:
a parameter's gradient is a DTensor whose local part is this rank's shard (dim 0, split over the
stage's replicas) once FSDP2 reduce-scattered it. A curvature method reads and writes the reduced
gradients it preconditions through `whole_gradient` and `set_gradient`, which pass plain tensors
through untouched, so the same method code runs unsharded (ZeRO-0/1) and sharded.

`whole_gradient` and `full` are collectives over the tensor's mesh (an all-gather): every replica
of a stage must call them on the same tensors in the same order (NCCL's rule). `shard_of` and
`set_gradient` communicate nothing.
"""

from __future__ import annotations

from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor


def is_sharded(tensor: Tensor | None) -> bool:
    """Whether `tensor` is a DTensor (an FSDP2 parameter or gradient)."""
    return isinstance(tensor, DTensor)


def local(tensor: Tensor) -> Tensor:
    """A DTensor's local part (this rank's shard); any other tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def full(tensor: Tensor) -> Tensor:
    """A DTensor gathered whole (a collective over its mesh); any other tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def shard_of(whole: Tensor, template: Tensor) -> DTensor:
    """`whole` (the same on every replica) laid out as `template` (a DTensor: its mesh and
    placements), in `template`'s device and dtype; no communication: each rank keeps its own part."""
    if not isinstance(template, DTensor):
        raise TypeError(f"shard_of: the template is a {type(template).__name__}, not a DTensor")
    whole = whole.to(device=template.device, dtype=template.dtype)
    return distribute_tensor(whole, template.device_mesh, template.placements, src_data_rank=None)


def whole_gradient(parameter: Tensor) -> Tensor | None:
    """`parameter`'s gradient whole (its shape): gathered over the mesh when sharded (collective),
    the gradient itself otherwise (writing into it writes the gradient); None without one."""
    grad = parameter.grad
    return None if grad is None else full(grad)


def set_gradient(parameter: Tensor, whole: Tensor) -> None:
    """Make `parameter`'s existing gradient `whole` (its shape, equal on every replica when
    sharded: this rank keeps its shard); no communication. A no-op when `whole` is the gradient
    `whole_gradient` returned for an unsharded parameter."""
    grad = parameter.grad
    if grad is None:
        raise ValueError("set_gradient: the parameter has no gradient to write into")
    target = local(grad)
    source = local(shard_of(whole, grad)) if isinstance(grad, DTensor) else whole
    if source.data_ptr() != target.data_ptr():
        target.copy_(source)


def shard_rows(parameter: Tensor) -> slice:
    """The rows (dim 0) of `parameter` whose values this rank holds: all of them unless it is a
    DTensor sharded on dim 0 (FSDP2's layout)."""
    rows = parameter.shape[0] if parameter.dim() else 1
    if not isinstance(parameter, DTensor):
        return slice(0, rows)
    mesh = parameter.device_mesh
    size, index = mesh.size(), mesh.get_local_rank()
    chunk = -(-rows // size)  # torch.chunk's split: ceil(rows / size) per rank, the last ones shorter or empty
    start = min(index * chunk, rows)
    return slice(start, min(start + chunk, rows))
