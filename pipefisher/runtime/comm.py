"""Point-to-point channels and collective groups over torch.distributed (gloo or NCCL alike).

Every boundary between stage s and s+1 of a pipe (per data-parallel replica) gets its own
two-rank process group, a *channel*: activations go forward and gradients backward on it, each
direction in micro-batch order on both ends. So messages match by order alone, which is all NCCL
offers, and never depend on tags. Replicas of a stage share one group for gradient all-reduces
and another for K-FAC's factor syncs and inverse exchanges.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from pipefisher.runtime.topology import Topology


@dataclass
class PendingRecv:
    """A posted receive: `tensor` is valid once `works` are waited for."""

    tensor: Tensor
    works: list = field(default_factory=list)

    def wait(self) -> Tensor:
        for work in self.works:
            work.wait()
        self.works.clear()
        return self.tensor


class Comm:
    """The process groups of one rank and the P2P/collective calls the executor makes.

    Group creation is collective: every rank constructs Comm with the same topology, in the same
    order, before the first step.
    """

    def __init__(self, topology: Topology, rank: int, device: torch.device):
        self.topology, self.rank, self.device = topology, rank, device
        self.channels: dict[tuple[int, int, int], dist.ProcessGroup] = {}
        schedule = topology.schedule
        for replica in range(topology.data_parallel):
            for pipe in range(schedule.num_pipes):
                for stage in range(schedule.num_stages - 1):
                    ends = sorted({topology.rank(replica, pipe, stage), topology.rank(replica, pipe, stage + 1)})
                    if len(ends) == 2:
                        group = dist.new_group(ends)
                        if rank in ends:
                            self.channels[(replica, pipe, stage)] = group
        self.replica_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        #: K-FAC's own collectives (factor syncs, inverse exchanges) run on separate groups: a plan
        #: may launch them in different steps on different ranks, which must never pair them with
        #: a step's gradient all-reduce
        self.kfac_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for stage in range(schedule.num_stages):
            ranks = topology.replica_ranks(stage)
            if len(ranks) > 1 and ranks not in self.replica_groups:
                self.replica_groups[ranks] = dist.new_group(list(ranks))
                self.kfac_groups[ranks] = dist.new_group(list(ranks))
        self._sends: list = []

    def channel(self, pipe: int, lower_stage: int) -> dist.ProcessGroup:
        return self.channels[(self.topology.replica_of(self.rank), pipe, lower_stage)]

    def exchange(self, sends: list[tuple[Tensor, int, dist.ProcessGroup]], recvs: list[tuple[tuple[int, ...], int, dist.ProcessGroup]]) -> list[PendingRecv]:
        """Post `sends` (tensor, peer, group) and `recvs` (shape, peer, group) in one batch.

        Sends complete in the background (waited for in `finish_sends`); receives are returned
        to be waited for right before use.
        """
        ops, pending = [], []
        for tensor, peer, group in sends:
            ops.append(dist.P2POp(dist.isend, tensor.contiguous(), peer, group))
        for shape, peer, group in recvs:
            buffer = torch.empty(shape, device=self.device)
            ops.append(dist.P2POp(dist.irecv, buffer, peer, group))
            pending.append(PendingRecv(buffer))
        if not ops:
            return pending
        works = dist.batch_isend_irecv(ops)
        self._sends.extend(works[: len(sends)])
        for receive, work in zip(pending, works[len(sends):]):
            receive.works.append(work)
        return pending

    def finish_sends(self) -> None:
        for work in self._sends:
            work.wait()
        self._sends.clear()

    def all_reduce_gradients(self, parameters_by_group: dict[tuple[int, ...], list[torch.nn.Parameter]]) -> None:
        """Sum gradients over each replica group (one flat all-reduce per group)."""
        for ranks, parameters in sorted(parameters_by_group.items()):
            grads = [p.grad for p in parameters if p.grad is not None]
            if not grads:
                continue
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.replica_groups[ranks])
            offset = 0
            for grad in grads:
                grad.copy_(flat[offset: offset + grad.numel()].view_as(grad))
                offset += grad.numel()

    def sum_over_world(self, values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return tensor.tolist()
