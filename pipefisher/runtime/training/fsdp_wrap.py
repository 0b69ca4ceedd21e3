"""ZeRO-2/3 (`optimizer.zero` 2 or 3): each stage module of a rank wrapped with PyTorch's FSDP2
`fully_shard` over the stage's data-parallel replicas, its repeated blocks first (one all-gather
per block), then the module itself (what is left: embeddings, heads, final norms). The mesh is
the stage's FSDP communicator of `Comm` (its ``grad`` one; with several pipes, its data-parallel
copies in the pipe) as a 1-D device mesh, so FSDP's collectives run on the group the communication
plan names (`pipefisher.planning.comm.plan`). ZeRO-3 reshards the
parameters after every forward; ZeRO-2 keeps them gathered through the step
(`pipefisher.runtime.gradient_path.sharded.FsdpReduction` reshards after the last backward)."""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from pipefisher.planning.comm.actions import fsdp_group
from pipefisher.runtime.pipeline.compiled import repeated_blocks
from pipefisher.runtime.primitives.comm import Comm


def shard_stages(
    modules: dict[tuple[int, int], nn.Module], comm: Comm, device: torch.device, zero: int, pipes: int = 1
) -> dict[int, nn.Module]:
    """Wrap every module of `modules` ((pipe, stage) -> module, on `device`) whose stage has an
    FSDP communicator (`pipefisher.planning.comm.actions.fsdp_group` of a schedule with `pipes`
    pipes: more than one replica to shard over) in place; returns stage -> its FSDP2 module.
    Collective over each stage's replicas (FSDP broadcasts nothing, but the mesh is built on
    every member)."""
    # A stage's output is detached before it is sent and only read out of place by the loss, so
    # FSDP's warning that an in-place op on a returned view would skip its pre-backward hook does
    # not apply (the equivalence tests hold every gradient to the reference).
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    sharded: dict[int, nn.Module] = {}
    for (pipe, stage), module in sorted(modules.items()):
        group = comm.groups.get(fsdp_group(stage, pipe, pipes))
        if group is None:
            continue
        mesh = DeviceMesh.from_group(group, device.type)
        after_forward = zero == 3
        for block in repeated_blocks(module):
            fully_shard(block, mesh=mesh, reshard_after_forward=after_forward)
        fully_shard(module, mesh=mesh, reshard_after_forward=after_forward)  # in place: `module` is the root
        for unit in module.modules():
            if isinstance(unit, FSDPModule):  # a sum over the replicas, as a plain SUM (gloo has no PREMUL_SUM)
                unit.set_gradient_divide_factor(1.0)
                unit.set_force_sum_reduction_for_comms(True)
        sharded[stage] = module
    return sharded
