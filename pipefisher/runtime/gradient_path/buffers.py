"""Gradient bookkeeping of a rank's stages: persistent flat buffers reduced in buckets, tied
weights, and the global norm for clipping, all on the device.

Every parameter has one *owner* among the ranks holding its stage (`Ownership`): only the owner's
copy contributes to sums over the model (each logical parameter counted once). Without ZeRO the
owner is the stage's lowest rank and every holder has the reduced gradient; with ZeRO-1 owners
are spread over the holders (`pipefisher.planning.replicas.zero`) and only the owner receives the reduced gradient.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor, nn

from pipefisher.core.topology import Topology
from pipefisher.models.tensor_parallel import split_parameters
from pipefisher.planning.replicas.zero import shard_owners
from pipefisher.runtime.primitives.comm import Comm, Handle, done
from pipefisher.runtime.primitives.grads import grad_of


def unique_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Trainable parameters of `module`, each once (a weight tied within the module counts once)."""
    seen: set[int] = set()
    found = []
    for parameter in module.parameters():
        if parameter.requires_grad and id(parameter) not in seen:
            seen.add(id(parameter))
            found.append(parameter)
    return found


class GradientBuffer:
    """The gradients of one stage's parameters, as views into one flat buffer that lives for the
    whole run: backward accumulates into it in place, parameters without a gradient in a step
    hold zeros, and the reduction over replicas sends it in buckets of at most `bucket_bytes`
    (cut at parameter boundaries).

    With `owners` (ZeRO-1: the owning global rank of each parameter, in `unique_parameters`
    order) buckets are also cut where the owner changes, `bucket_owners[i]` names bucket i's
    owner, and the parameters themselves move into a flat buffer of the same layout
    (`parameter_buckets[i]` is bucket i's parameters), so an owner broadcasts its updated run
    bucket by bucket."""

    def __init__(self, module: nn.Module, bucket_bytes: int, owners: list[int] | None = None):
        parameters = unique_parameters(module)
        dtypes = {p.dtype for p in parameters}
        if len(dtypes) > 1:
            raise ValueError(
                f"a stage's parameters must share one dtype for its gradient buffer, got {sorted(map(str, dtypes))}"
            )
        device = parameters[0].device if parameters else torch.device("cpu")
        dtype = next(iter(dtypes), torch.float32)
        self.flat = torch.zeros(sum(p.numel() for p in parameters), dtype=dtype, device=device)
        self.parameters = parameters
        self.owners = owners
        self.gradients: list[Tensor] = []
        self.buckets: list[Tensor] = []
        self.bucket_owners: list[int] = []
        bounds: list[tuple[int, int]] = []
        offset, start, first = 0, 0, 0
        for index, parameter in enumerate(parameters):
            view = self.flat[offset : offset + parameter.numel()].view_as(parameter)
            parameter.grad = view
            self.gradients.append(view)
            new_owner = owners is not None and index > first and owners[index] != owners[first]
            too_big = (offset + parameter.numel() - start) * self.flat.element_size() > bucket_bytes
            if offset > start and (new_owner or too_big):
                bounds.append((start, offset))
                self.bucket_owners.append(owners[first] if owners is not None else -1)
                start, first = offset, index
            offset += parameter.numel()
        if offset > start:
            bounds.append((start, offset))
            self.bucket_owners.append(owners[first] if owners is not None else -1)
        self.buckets = [self.flat[a:b] for a, b in bounds]
        self.parameter_buckets: list[Tensor] = []
        if owners is not None:
            self.parameter_flat = torch.empty_like(self.flat)
            offset = 0
            for parameter in parameters:
                view = self.parameter_flat[offset : offset + parameter.numel()].view_as(parameter)
                view.copy_(parameter.detach())
                parameter.data = view
                offset += parameter.numel()
            self.parameter_buckets = [self.parameter_flat[a:b] for a, b in bounds]

    def zero_(self) -> None:
        self.flat.zero_()


class Ownership:
    """The owner rank of every parameter of this rank's stages: the rank whose copy counts once
    in sums over the model and, with ZeRO-1 (`sharded`), the only rank that receives its reduced
    gradient, keeps its optimizer state and updates it (then broadcasts it). Without ZeRO the
    owner is the stage's lowest rank and every holder updates its own copy."""

    def __init__(self, topology: Topology, rank: int, modules: dict[tuple[int, int], nn.Module], sharded: bool):
        self.rank, self.sharded = rank, sharded
        #: (pipe, stage) -> the owner of each parameter, in `unique_parameters` order
        self.owners: dict[tuple[int, int], list[int]] = {}
        self._owner: dict[int, int] = {}
        for (pipe, stage), module in modules.items():
            parameters = unique_parameters(module)
            ranks = topology.replica_ranks(stage)
            owners = shard_owners([p.numel() for p in parameters], ranks) if sharded else [ranks[0]] * len(parameters)
            self.owners[(pipe, stage)] = owners
            self._owner.update(zip(map(id, parameters), owners))

    def counts(self, parameter: nn.Parameter) -> bool:
        """Whether this rank's copy of `parameter` is the one counted in sums over the model."""
        return self._owner.get(id(parameter)) == self.rank

    def updates(self, parameter: nn.Parameter) -> bool:
        """Whether this rank updates `parameter` (and keeps its optimizer state)."""
        return not self.sharded or self.counts(parameter)


class TiedGradients:
    """Sums the gradients of the copies of a weight two stages hold (e.g. BERT's word embedding
    and MLM decoder) and gives every copy the sum, as if the weight were one Parameter. Runs after
    each stage's gradients are reduced over its replicas."""

    def __init__(
        self,
        topology: Topology,
        ownership: Ownership,
        stages: dict[tuple[int, int], nn.Module],
        tied: list[tuple[str, str]],
        ranks: tuple[int, ...],
    ):
        self.ownership = ownership
        where = {"first": 0, "last": topology.schedule.num_stages - 1}
        self.copies: list[tuple[int, nn.Parameter]] = []
        for (pipe, stage), module in sorted(stages.items()):
            parameters = dict(module.named_parameters())
            for selector, name in tied:
                if where[selector] == stage and name in parameters:
                    self.copies.append((stage, parameters[name]))
        #: every rank holding a copy (the group the sum runs over)
        self.ranks = ranks

    def launch(self, comm: Comm) -> Handle:
        """Start the sum; `wait()` gives every copy of this rank the total."""
        if not self.copies:
            return done()
        total = torch.zeros_like(self.copies[0][1])
        for stage, parameter in self.copies:
            if self.ownership.counts(parameter):
                total += grad_of(parameter)

        def store() -> None:
            for _, parameter in self.copies:
                grad_of(parameter).copy_(total)

        if len(self.ranks) < 2:
            store()
            return done()
        return comm.all_reduce([total], ("tied",), on_done=store)


class SquaredNorm(Protocol):
    """What clipping reads: Σ‖g‖² of the gradients this rank counts (0-dim float64 on `device`),
    summed over the ranks by the step's world reduction."""

    def local_square(self, device: torch.device) -> Tensor: ...


class GlobalNorm:
    """The L2 norm of the whole model's gradient, each logical parameter counted once: this
    process's share of the squared norm (`local_square`, over the parameters it owns; of what the
    tensor-parallel processes of a rank hold whole, shard 0 counts it), summed over all processes
    by the caller."""

    def __init__(
        self,
        topology: Topology,
        ownership: Ownership,
        stages: dict[tuple[int, int], nn.Module],
        tied: list[tuple[str, str]],
        shard: int = 0,
    ):
        last = topology.schedule.num_stages - 1
        # the last stage's tied copy duplicates the first stage's: count it once
        skip = {(last, name) for selector, name in tied if selector == "last"} if last > 0 else set()
        self.counted: list[nn.Parameter] = []
        for (pipe, stage), module in sorted(stages.items()):
            split = split_parameters(module)
            for name, parameter in module.named_parameters():
                if (
                    (stage, name) not in skip
                    and parameter.requires_grad
                    and ownership.counts(parameter)
                    and (shard == 0 or parameter in split)
                ):
                    self.counted.append(parameter)

    def local_square(self, device: torch.device) -> Tensor:
        """Σ‖g‖² over this rank's counted parameters (0-dim float64, on `device`)."""
        if not self.counted:
            return torch.zeros((), dtype=torch.float64, device=device)
        norms = torch._foreach_norm([grad_of(p) for p in self.counted])
        return torch.stack(norms).double().square().sum()


def clip_coefficient(square: Tensor, max_norm: float) -> Tensor:
    """min(1, max_norm / (‖g‖ + 1e-6)) from the global squared norm, as
    `torch.nn.utils.clip_grad_norm_` computes it (float32, on the device)."""
    return (max_norm / (square.sqrt() + 1e-6)).clamp(max=1.0).float()
