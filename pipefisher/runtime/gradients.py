"""Gradient bookkeeping across stages: tied weights and global-norm clipping.

Both run after the gradients of each stage are summed over its replicas, so every holder of a
stage has the same gradient; a stage's *representative* is the lowest rank holding it, and only
representatives contribute to sums over the model (each logical parameter counted once).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from pipefisher.runtime.topology import Topology


def representative(topology: Topology, stage: int) -> int:
    return min(topology.replica_ranks(stage))


class TiedGradients:
    """Sums the gradients of the copies of a weight two stages hold (e.g. BERT's word embedding
    and MLM decoder) and gives every copy the sum, as if the weight were one Parameter."""

    def __init__(self, topology: Topology, rank: int, stages: dict[tuple[int, int], nn.Module], tied: list[tuple[str, str]]):
        self.topology, self.rank = topology, rank
        last = topology.schedule.num_stages - 1
        where = {"first": 0, "last": last}
        self.copies: list[tuple[int, nn.Parameter]] = []
        for (pipe, stage), module in sorted(stages.items()):
            parameters = dict(module.named_parameters())
            for selector, name in tied:
                if where[selector] == stage and name in parameters:
                    self.copies.append((stage, parameters[name]))
        self.ranks = tuple(sorted(set(topology.replica_ranks(0)) | set(topology.replica_ranks(last)))) if tied and last > 0 else ()
        self.group = None

    def create_group(self) -> None:
        """Collective: every rank calls it (in the same order as its other group creations)."""
        if len(self.ranks) > 1:
            self.group = dist.new_group(list(self.ranks))

    def __call__(self) -> None:
        if not self.copies or (len(self.ranks) < 2 and len({stage for stage, _ in self.copies}) < 2):
            return  # one stage holds the only copy: nothing to combine
        total = torch.zeros_like(self.copies[0][1])
        for stage, parameter in self.copies:
            if parameter.grad is not None and representative(self.topology, stage) == self.rank:
                total += parameter.grad
        if self.group is not None:
            dist.all_reduce(total, group=self.group)
        for _, parameter in self.copies:
            if parameter.grad is None:
                parameter.grad = total.clone()
            else:
                parameter.grad.copy_(total)


class GradientClipper:
    """Scales all gradients so that the global L2 norm over the whole model is at most `max_norm`
    (each logical parameter counted once); returns the norm before clipping."""

    def __init__(self, topology: Topology, rank: int, stages: dict[tuple[int, int], nn.Module], tied: list[tuple[str, str]], max_norm: float, device: torch.device):
        self.max_norm, self.device = max_norm, device
        last = topology.schedule.num_stages - 1
        # the last stage's tied copy duplicates the first stage's: count it once
        skip = {(last, name) for selector, name in tied if selector == "last"} if last > 0 else set()
        self.counted: list[nn.Parameter] = []
        self.all: list[nn.Parameter] = []
        for (pipe, stage), module in sorted(stages.items()):
            for name, parameter in module.named_parameters():
                self.all.append(parameter)
                if representative(topology, stage) == rank and (stage, name) not in skip:
                    self.counted.append(parameter)

    def __call__(self) -> float:
        squares = sum(float(p.grad.double().pow(2).sum()) for p in self.counted if p.grad is not None)
        total = torch.tensor([squares], dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        norm = math.sqrt(float(total.item()))
        if self.max_norm > 0 and norm > self.max_norm:
            scale = self.max_norm / (norm + 1e-6)
            for parameter in self.all:
                if parameter.grad is not None:
                    parameter.grad.mul_(scale)
        return norm
