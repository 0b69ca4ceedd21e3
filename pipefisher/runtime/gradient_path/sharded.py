"""ZeRO-2/3's gradient path: the stages' parameters are PyTorch FSDP2 modules
(`pipefisher.runtime.training.fsdp_wrap`), whose own hooks all-gather the parameters inside each
forward and backward and reduce-scatter the gradients inside a backward. This strategy only says
*which* backward reduces: FSDP's gradient sync is off except during the stage's last backward of
the step, armed by the plan's ``grad`` collective (launched right before that op, waited for right
after it), so the reduce-scatter runs once per step, summing over the replicas (divide factor 1:
the loss is already scaled by 1 / the step's micro-batches over all replicas). Between steps each
rank holds its shard of every gradient (a DTensor's local part); the global norm sums the squares
of those shards, each element counted once over the world.

The executor's gradient buffers (`pipefisher.runtime.gradient_path.buffers`) hold none of these
parameters: a sharded stage has no buffer. Steps that drop their gradients (`StepEnd.begin` with
`update` False: the profiler's) still arm the last backward, so its reduce-scatter runs as in a
real step and leaves no whole gradient accumulated in FSDP; the step's end drops the shards
(`zero_`) without an optimizer step. There is no reduction outside a backward (`reduce_now`):
the profiler takes a sharded stage's `grad_reduce` from its step records instead
(`pipefisher.runtime.training.profiler`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from pipefisher.models.tensor_parallel import split_parameters
from pipefisher.planning.comm.actions import Collective
from pipefisher.runtime.gradient_path.reduction import GradientReduction
from pipefisher.runtime.primitives.comm import Comm, Handle
from pipefisher.runtime.primitives.sharding import full, local, shard_of


def fsdp_modules(module: nn.Module) -> list[FSDPModule]:
    """Every FSDP2 module in `module` (itself included), outermost first."""
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


class FsdpReduction(GradientReduction):
    """The reduce-scatter of each sharded stage (`stages`: stage -> its FSDP2 root module) once per
    step; `keep_gathered` (ZeRO-2): the parameters also stay gathered until that backward. With
    `pipes` > 1 (Chimera) FSDP2 shards over a pipe's replicas only, and each shard is then summed
    over the stage's copies in every pipe (``grad_pipes``): every shard is held by `pipes` ranks."""

    def __init__(self, stages: dict[int, nn.Module], keep_gathered: bool, pipes: int = 1):
        super().__init__({})
        self.stages, self.keep_gathered, self.pipes = stages, keep_gathered, pipes
        for stage in stages:
            self._arm(stage, False)

    def _arm(self, stage: int, last: bool) -> None:
        module = self.stages[stage]
        if not isinstance(module, FSDPModule):
            raise TypeError(f"stage {stage}: a {type(module).__name__} is not sharded by FSDP2")
        module.set_requires_gradient_sync(last)
        if self.keep_gathered:
            module.set_reshard_after_backward(last)

    def launch_grad(self, comm: Comm, collective: Collective, step: int) -> Handle:
        """Arm the stage's reduce-scatter for the op that follows (its last backward of the step);
        waiting disarms it (the op has run: its gradients are reduced and sharded)."""
        stage = collective.key[0]
        self._arm(stage, True)
        return Handle(lambda: None, lambda: self._arm(stage, False))

    def launch_grad_pipes(self, comm: Comm, collective: Collective) -> Handle:
        """Sum this rank's gradient shards of stage `collective.key[0]` over its copies in every
        pipe (an all-reduce on the collective's communicator)."""
        module = self.stages[collective.key[0]]
        shards = [local(p.grad) for p in module.parameters() if p.requires_grad and p.grad is not None]
        return comm.all_reduce(shards, collective.group)

    def reduce_now(self, comm: Comm, stage: int, step: int) -> None:
        raise NotImplementedError("optimizer.zero 2/3 reduces inside the last backward; there is no separate reduction")

    def parameters(self) -> list[nn.Parameter]:
        return [p for module in self.stages.values() for p in module.parameters() if p.requires_grad]

    def shards(self) -> list[Tensor]:
        """This rank's shards of the reduced gradients (those a step produced)."""
        return [local(p.grad) for p in self.parameters() if p.grad is not None]

    def scale_(self, coefficient: Tensor) -> None:
        shards = self.shards()
        if shards:
            torch._foreach_mul_(shards, coefficient)

    def fill_(self, value: float) -> None:
        """Every sharded gradient set to `value` (this rank's shard of a tensor full of it: the
        profiler's stand-in for a reduced gradient when it times the step's end)."""
        for p in self.parameters():
            p.grad = torch.full_like(p, value)

    def zero_(self) -> None:
        for p in self.parameters():
            p.grad = None


def like(value: object, template: object) -> object:
    """`value` (whole, the same on every replica) laid out as `template`: a DTensor's shard of it
    (no communication), nested dicts entry by entry; anything else as it is."""
    if isinstance(template, DTensor) and isinstance(value, Tensor) and not isinstance(value, DTensor):
        return shard_of(value, template)
    if isinstance(template, dict) and isinstance(value, dict):
        return {key: like(item, template.get(key)) for key, item in value.items()}
    return value


def like_parameter(entry: dict, parameter: Tensor) -> dict:
    """A parameter's optimizer state `entry` (whole tensors) with each tensor of the parameter's
    shape laid out as `parameter` (a DTensor's shard); others (a step count) as they are."""
    return {
        key: like(value, parameter) if isinstance(value, Tensor) and value.shape == parameter.shape else value
        for key, value in entry.items()
    }


def gathered(value: object) -> object:
    """Nested dicts, lists and tuples with every DTensor gathered whole (collective)."""
    return _each_tensor(value, full)


def localized(value: object) -> object:
    """Nested dicts, lists and tuples with every DTensor replaced by its local part."""
    return _each_tensor(value, local)


def _each_tensor(value: object, change: Callable[[Tensor], Tensor]) -> object:
    if isinstance(value, Tensor):
        return change(value)
    if isinstance(value, dict):
        return {key: _each_tensor(item, change) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_each_tensor(item, change) for item in value)
    return value


class ShardedNorm:
    """The squared global gradient norm's share of this rank under ZeRO-2/3: Σ‖shard‖² over the
    local shards of its sharded stages' gradients over the copies of each shard (a pipe's replicas
    hold disjoint shards, each held once per pipe, so the sum over all processes counts every
    element once); of what a rank's tensor-parallel processes hold whole, `shard` 0 counts it.
    Same contract as `GlobalNorm.local_square`."""

    def __init__(self, reduction: FsdpReduction, shard: int = 0):
        self.reduction = reduction
        self.counted = [
            parameter
            for module in reduction.stages.values()
            for parameter in module.parameters()
            if parameter.requires_grad and (shard == 0 or parameter in split_parameters(module))
        ]

    def local_square(self, device: torch.device) -> Tensor:
        shards = [local(p.grad) for p in self.counted if p.grad is not None]
        if not shards:
            return torch.zeros((), dtype=torch.float64, device=device)
        return torch.stack(torch._foreach_norm(shards)).double().square().sum() / self.reduction.pipes


def local_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of the local storage of `tensors` (a DTensor's shard), each storage once."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = local(tensor).untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
