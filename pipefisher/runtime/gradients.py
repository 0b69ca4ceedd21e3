"""Gradient bookkeeping of a rank's stages: persistent flat buffers reduced in buckets, tied
weights, and the global norm for clipping, all on the device.

Every holder of a stage has the same gradient once its buffer is reduced over the stage's
replicas; a stage's *representative* is the lowest rank holding it, and only representatives
contribute to sums over the model (each logical parameter counted once).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from pipefisher.runtime.comm import Comm, Handle, done
from pipefisher.topology import Topology


def representative(topology: Topology, stage: int) -> int:
    return min(topology.replica_ranks(stage))


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
    (cut at parameter boundaries)."""

    def __init__(self, module: nn.Module, bucket_bytes: int):
        parameters = unique_parameters(module)
        dtypes = {p.dtype for p in parameters}
        if len(dtypes) > 1:
            raise ValueError(f"a stage's parameters must share one dtype for its gradient buffer, got {sorted(map(str, dtypes))}")
        device = parameters[0].device if parameters else torch.device("cpu")
        self.flat = torch.zeros(sum(p.numel() for p in parameters), dtype=next(iter(dtypes), torch.float32), device=device)
        self.gradients: list[Tensor] = []
        self.buckets: list[Tensor] = []
        offset, start = 0, 0
        for parameter in parameters:
            view = self.flat[offset: offset + parameter.numel()].view_as(parameter)
            parameter.grad = view
            self.gradients.append(view)
            if offset > start and (offset + parameter.numel() - start) * self.flat.element_size() > bucket_bytes:
                self.buckets.append(self.flat[start:offset])
                start = offset
            offset += parameter.numel()
        if offset > start:
            self.buckets.append(self.flat[start:offset])

    def zero_(self) -> None:
        self.flat.zero_()


class TiedGradients:
    """Sums the gradients of the copies of a weight two stages hold (e.g. BERT's word embedding
    and MLM decoder) and gives every copy the sum, as if the weight were one Parameter. Runs after
    each stage's gradients are reduced over its replicas."""

    def __init__(self, topology: Topology, rank: int, stages: dict[tuple[int, int], nn.Module], tied: list[tuple[str, str]], ranks: tuple[int, ...]):
        self.topology, self.rank = topology, rank
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
            if representative(self.topology, stage) == self.rank:
                total += parameter.grad

        def store() -> None:
            for _, parameter in self.copies:
                parameter.grad.copy_(total)

        if len(self.ranks) < 2:
            store()
            return done()
        return comm.all_reduce([total], ("tied",), on_done=store)


class GlobalNorm:
    """The L2 norm of the whole model's gradient, each logical parameter counted once: this rank's
    share of the squared norm (`local_square`), summed over all ranks by the caller."""

    def __init__(self, topology: Topology, rank: int, stages: dict[tuple[int, int], nn.Module], tied: list[tuple[str, str]]):
        last = topology.schedule.num_stages - 1
        # the last stage's tied copy duplicates the first stage's: count it once
        skip = {(last, name) for selector, name in tied if selector == "last"} if last > 0 else set()
        self.counted: list[nn.Parameter] = []
        for (pipe, stage), module in sorted(stages.items()):
            if representative(topology, stage) != rank:
                continue
            for name, parameter in module.named_parameters():
                if (stage, name) not in skip and parameter.requires_grad:
                    self.counted.append(parameter)

    def local_square(self, device: torch.device) -> Tensor:
        """Σ‖g‖² over this rank's counted parameters (0-dim float64, on `device`)."""
        if not self.counted:
            return torch.zeros((), dtype=torch.float64, device=device)
        norms = torch._foreach_norm([p.grad for p in self.counted])
        return torch.stack(norms).double().square().sum()


def clip_coefficient(square: Tensor, max_norm: float) -> Tensor:
    """min(1, max_norm / (‖g‖ + 1e-6)) from the global squared norm, as
    `torch.nn.utils.clip_grad_norm_` computes it (float32, on the device)."""
    return (max_norm / (square.sqrt() + 1e-6)).clamp(max=1.0).float()
