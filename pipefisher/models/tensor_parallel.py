"""Tensor parallelism of a stage, Megatron-style, through PyTorch's `parallelize_module`.

A model's plan (`tensor_parallel_plan()`: module-name globs -> `Split`, see
`pipefisher.core.tensor_parallel`) names the Linear layers to split. On a tensor-parallel process
each of them keeps its shard only, as a plain `nn.Linear` under its global name, so optimizers,
checkpoints and every curvature method see an ordinary, smaller layer: the method's statistics,
inverses and roots are those of the shard's block (3D-Shampoo's per-shard preconditioning). The
collectives ride on the layer's hooks: a column-split layer's input gradient and a row-split
layer's output are summed over the rank's processes (`Comm.tensor_all_reduce`, on the device
mesh's tensor dimension, in the issue order the replay checks).

The single-process reference holds all T shards of a layer side by side (`ShardedLinear`), each
its own `nn.Linear` named ``<layer>.shards.<t>``, so the same methods see the same blocks there.
`unsharded_parameters` and `gather_parameters` give both back under the unsplit model's names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module
from torch.utils.weak import WeakTensorKeyDictionary

from pipefisher.core.tensor_parallel import Split, TensorParallelPlan, holds_bias, shard_range, split_dim, split_of
from pipefisher.runtime.primitives.sharding import full

#: the attribute `parallelize` marks each layer it split with (its `Split`)
SPLIT_ATTRIBUTE = "tensor_split"

#: sums a tensor over the rank's tensor-parallel processes, in place, and returns it
Reduce = Callable[[Tensor], Tensor]


class _CopyToShards(torch.autograd.Function):
    """Identity forward; the gradient summed over the shards (a column-split layer's input)."""

    @staticmethod
    def forward(ctx, x: Tensor, reduce: Reduce) -> Tensor:
        ctx.reduce = reduce
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return ctx.reduce(grad.clone(memory_format=torch.contiguous_format)), None


class _SumOverShards(torch.autograd.Function):
    """The partial outputs summed over the shards (a row-split layer's); identity backward."""

    @staticmethod
    def forward(ctx, y: Tensor, reduce: Reduce) -> Tensor:
        return reduce(y.clone(memory_format=torch.contiguous_format))

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def shard_linear(full: nn.Linear, split: Split, degree: int, index: int) -> nn.Linear:
    """Shard `index` of `degree` of `full` as a new Linear with copies of its slices
    (`pipefisher.core.tensor_parallel`); a row split's bias only on shard 0."""
    weight = full.weight.detach()
    dim = split_dim(split)
    start, stop = shard_range(weight.shape[dim], degree, index)
    has_bias = full.bias is not None and holds_bias(split, index)
    part = weight.narrow(dim, start, stop - start)
    shard = nn.Linear(part.shape[1], part.shape[0], bias=has_bias, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        shard.weight.copy_(part)
        if has_bias:
            shard.bias.copy_(full.bias[start:stop] if split is Split.COLUMN else full.bias)
    shard.train(full.training)
    return shard


class _LocalShard(ParallelStyle):
    """Keep this process's shard of a Linear (in place: the same module, a smaller weight) and
    sum over the shards where the split needs it. Column-split layers that read one input (query,
    key and value; Llama's gate and up) share one `_CopyToShards` of it (`copies`), so its
    gradient is summed once, as Megatron does: two all-reduces per block in the forward, two in
    the backward."""

    def __init__(self, split: Split, reduce: Reduce, copies: WeakTensorKeyDictionary):
        super().__init__()
        self.split, self.reduce, self.copies = split, reduce, copies

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise TypeError(f"tensor-parallel plan: {type(module).__name__} is not a Linear layer")
        shard = shard_linear(module, self.split, device_mesh.size(), device_mesh.get_local_rank())
        module.weight, module.bias = shard.weight, shard.bias
        module.out_features, module.in_features = shard.weight.shape
        setattr(module, SPLIT_ATTRIBUTE, self.split)
        reduce, copies = self.reduce, self.copies
        if self.split is Split.COLUMN:

            def copy_input(_, args):
                if args[0] not in copies:
                    copies[args[0]] = _CopyToShards.apply(args[0], reduce)
                return (copies[args[0]], *args[1:])

            module.register_forward_pre_hook(copy_input)
        else:
            module.register_forward_hook(lambda _, args, output: _SumOverShards.apply(output, reduce))
        return module


def parallelize(module: nn.Module, plan: TensorParallelPlan, mesh: DeviceMesh, reduce: Reduce) -> nn.Module:
    """`module` with this process's shards of the plan's layers (`mesh`: the tensor dimension)."""
    copies = WeakTensorKeyDictionary()
    return parallelize_module(
        module, mesh, {pattern: _LocalShard(split, reduce, copies) for pattern, split in plan.items()}
    )


class ShardedLinear(nn.Module):
    """All `degree` shards of a Linear in one process (the reference): ``shards.<t>`` is shard t;
    forward concatenates a column split's outputs, sums a row split's over its input slices."""

    def __init__(self, full: nn.Linear, split: Split, degree: int):
        super().__init__()
        self.split = split
        self.shards = nn.ModuleList(shard_linear(full, split, degree, index) for index in range(degree))

    def forward(self, x: Tensor) -> Tensor:
        if self.split is Split.COLUMN:
            return torch.cat([shard(x) for shard in self.shards], dim=-1)
        slices = x.chunk(len(self.shards), dim=-1)
        return sum(shard(part) for shard, part in zip(self.shards, slices))

    def unsharded(self) -> dict[str, Tensor]:
        """The unsplit layer's weight (and bias), detached."""
        linears = [shard for shard in self.shards if isinstance(shard, nn.Linear)]
        full = {"weight": join_shards(self.split, "weight", [shard.weight.detach() for shard in linears])}
        biases = [shard.bias.detach() for shard in linears if shard.bias is not None]
        if biases:
            full["bias"] = join_shards(self.split, "bias", biases)
        return full


def emulate_shards(module: nn.Module, plan: TensorParallelPlan, degree: int) -> nn.Module:
    """`module` with each of the plan's Linear layers replaced by a `ShardedLinear` of `degree`
    shards (the single-process reference of a tensor-parallel run)."""
    targets = [
        (name, child, split)
        for name, child in module.named_modules()
        if (split := split_of(name, plan)) is not None and isinstance(child, nn.Linear)
    ]
    for name, child, split in targets:
        parent_name, _, attribute = name.rpartition(".")
        setattr(module.get_submodule(parent_name), attribute, ShardedLinear(child, split, degree))
    return module


def unsharded_parameters(module: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(name, detached tensor) of every parameter under the unsplit model's names, a
    `ShardedLinear`'s shards joined."""
    sharded = {name: child for name, child in module.named_modules() if isinstance(child, ShardedLinear)}
    for name, child in sharded.items():
        for key, tensor in child.unsharded().items():
            yield f"{name}.{key}", tensor
    for name, parameter in module.named_parameters():
        if not any(name.startswith(f"{prefix}.shards.") for prefix in sharded):
            yield name, parameter.detach()


def join_shards(split: Split, kind: str, parts: list[Tensor]) -> Tensor:
    """A split layer's unsplit `kind` ("weight" or "bias") from its shards' `parts`, in shard order
    (a row split's bias: the one part, shard 0's)."""
    if kind == "bias" and split is Split.ROW:
        return parts[0]
    return torch.cat(parts, dim=split_dim(split) if kind == "weight" else 0)


def join_shard_states(states: list[dict[str, Tensor]], plan: TensorParallelPlan) -> dict[str, Tensor]:
    """One state dict of the unsplit stage from its shards' (`states[t]`: process t's, of a stage
    split by `plan` over len(states) processes): split layers' weights and biases joined, the rest
    taken from shard 0 (every shard holds it whole)."""
    joined = dict(states[0])
    for key in states[0]:
        module, _, kind = key.rpartition(".")
        split = split_of(module, plan)
        if split is not None and kind in ("weight", "bias"):
            joined[key] = join_shards(split, kind, [state[key] for state in states if key in state])
    return joined


def applied_plan(module: nn.Module) -> dict[str, Split]:
    """The split of each of `module`'s layers that `parallelize` split, by exact name."""
    splits = {name: getattr(child, SPLIT_ATTRIBUTE, None) for name, child in module.named_modules()}
    return {name: split for name, split in splits.items() if isinstance(split, Split)}


def split_parameters(module: nn.Module) -> set[nn.Parameter]:
    """The parameters of `module`'s tensor-parallel shards (what each process holds a part of)."""
    return {
        parameter for name in applied_plan(module) for parameter in module.get_submodule(name).parameters(recurse=False)
    }


def gather_parameters(module: nn.Module, group: dist.ProcessGroup) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) of every parameter of a tensor-parallel process's `module`, split layers
    gathered from the processes of `group` (collective: every process of the group calls it, and
    under ZeRO-2/3 its data-parallel replicas gather FSDP2's shards first); a row split's bias only
    where it lives, on shard 0."""
    degree = dist.get_world_size(group)
    splits = applied_plan(module)
    for name, split in splits.items():
        for kind in ("weight", "bias"):
            local = getattr(module.get_submodule(name), kind)
            local = local if local is None else full(local)  # ZeRO-2/3: this process's shard, whole
            if local is None:
                continue
            if kind == "bias" and split is Split.ROW:  # whole, on shard 0
                parts = [local.detach()]
            else:
                parts = [torch.empty_like(local) for _ in range(degree)]
                dist.all_gather(parts, local.detach().contiguous(), group=group)
            yield f"{name}.{kind}", join_shards(split, kind, parts)
    for name, parameter in module.named_parameters():
        if name.rpartition(".")[0] not in splits:
            yield name, parameter.detach()
