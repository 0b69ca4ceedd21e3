"""The process groups of one rank and the point-to-point and collective calls the executor makes.

One process group per communicator of `pipefisher.planning.comm.plan` (per direction of every stage
boundary, per stage for gradients and for K-FAC, tied weights, the end-of-step reduction), all
created by every rank in the same order. Every call is asynchronous and returns a `Handle`.

`in_order=True` holds gloo to NCCL's rule: an operation on a group starts only after every
earlier operation on that group has completed (a thread per group starts them one by one), so
the multi-process tests on CPUs fail where NCCL would hang.
"""

from __future__ import annotations

import queue
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from pipefisher.core.topology import Topology
from pipefisher.planning.comm.actions import GroupKey
from pipefisher.planning.comm.processes import process_members, shard_key
from pipefisher.planning.comm.volume import ring_bytes

#: the communicator of this rank's tensor-parallel processes
TENSOR: GroupKey = ("tensor",)
#: starts the operations of one call on a group; returns their works
Start = Callable[[dist.ProcessGroup], list]


class Handle:
    """Communication in flight: `wait()` blocks until it is done, then runs `on_done` once."""

    def __init__(self, wait: Callable[[], None], on_done: Callable[[], None] | None = None):
        self._wait, self._on_done, self._finished = wait, on_done, False

    def wait(self) -> None:
        if self._finished:
            return
        self._wait()
        self._finished = True
        if self._on_done is not None:
            self._on_done()


def done() -> Handle:
    """A handle with nothing to wait for."""
    return Handle(lambda: None)


@dataclass
class _Batch:
    """The tensors of one root, dtype and device sent as one flat buffer (`coalesced`)."""

    root: int
    tensors: list[Tensor]
    flat: Tensor
    receives: bool

    def unpack(self) -> None:
        """A receiver's copy of the flat buffer into its tensors (one foreach copy)."""
        if self.receives and len(self.tensors) > 1:
            parts = torch.split(self.flat, [t.numel() for t in self.tensors])
            torch._foreach_copy_(self.tensors, [p.view_as(t) for p, t in zip(parts, self.tensors)])


def coalesced(pairs: list[tuple[Tensor, int]], rank: int) -> list[_Batch]:
    """`pairs` grouped by (root, dtype, device) in order of first sight, each group one flat
    buffer: the root's tensors concatenated, a receiver's empty; a group of one is the tensor."""
    groups: dict[tuple, list[Tensor]] = {}
    for tensor, root in pairs:
        groups.setdefault((root, tensor.dtype, tensor.device), []).append(tensor)
    batches = []
    for (root, dtype, device), tensors in groups.items():
        if len(tensors) == 1:
            flat = tensors[0]
        elif root == rank:
            flat = torch.cat([t.reshape(-1) for t in tensors])
        else:
            flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=device)
        batches.append(_Batch(root, tensors, flat, root != rank))
    return batches


class _Lane:
    """Starts the calls of one group strictly one after another, each once the previous completed."""

    def __init__(self, name: str):
        self._calls: queue.Queue = queue.Queue()
        threading.Thread(target=self._serve, name=f"in-order {name}", daemon=True).start()

    def submit(self, start: Callable[[], list]) -> Future:
        future: Future = Future()
        self._calls.put((start, future))
        return future

    def _serve(self) -> None:
        while True:
            start, future = self._calls.get()
            try:
                for work in start():
                    work.wait()
                future.set_result(None)
            except BaseException as exc:  # handed to the waiting thread
                future.set_exception(exc)


class Comm:
    """Process groups of `members` (group key -> ranks) and asynchronous calls on them.

    Collective construction: every process builds Comm with the same `members`, before the first
    step. With tensor parallelism (`topology.tensor_parallel` > 1) this process is shard `shard`
    of `rank`: it creates every process's copy of every group
    (`pipefisher.planning.comm.processes`), keeps its shard's, and addresses peers by rank; the
    rank's tensor-parallel processes share `tensor_group` (``TENSOR``).
    """

    def __init__(
        self,
        members: dict[GroupKey, tuple[int, ...]],
        rank: int,
        in_order: bool = False,
        timeout: float = 60.0,
        topology: Topology | None = None,
        shard: int = 0,
        tensor_group: dist.ProcessGroup | None = None,
    ):
        self.rank, self.in_order, self.timeout = rank, in_order, timeout
        self.members = members
        self.shard = shard
        self._process = (lambda r: r) if topology is None else (lambda r: topology.process(r, shard))
        #: bytes this rank sent, by communicator kind (a group key's first part), under ring
        #: algorithms' volume (`pipefisher.planning.comm.volume`); the step end reads and clears it
        self.sent_bytes: Counter[str] = Counter()
        self.groups: dict[GroupKey, dist.ProcessGroup] = {}
        processes = members if topology is None else process_members(topology, members)
        mine = {key if topology is None else shard_key(key, shard, topology): key for key in members}
        for key in sorted(processes, key=repr):
            if key[0] == TENSOR[0]:
                continue  # the device mesh's
            group = dist.new_group(list(processes[key]))
            if key in mine and self._process(rank) in processes[key]:
                self.groups[mine[key]] = group
        if tensor_group is not None:
            self.groups[TENSOR] = tensor_group
            self.members = {**members, TENSOR: tuple(range(dist.get_world_size(tensor_group)))}
        self._lanes = {key: _Lane("/".join(map(str, key))) for key in self.groups} if in_order else {}

    def group(self, key: GroupKey) -> dist.ProcessGroup:
        return self.groups[key]

    def call(self, key: GroupKey, start: Start, on_done: Callable[[], None] | None = None) -> Handle:
        """Run `start(group)` on the group of `key` (in order, in the in-order mode)."""
        group = self.groups[key]
        if self.in_order:
            future = self._lanes[key].submit(lambda: start(group))

            def wait() -> None:
                try:
                    future.result(timeout=self.timeout)
                except TimeoutError:
                    raise TimeoutError(
                        f"nothing completed on group {key} within {self.timeout:g} s (in-order mode)"
                    ) from None

            return Handle(wait, on_done)
        works = start(group)

        def wait_all() -> None:
            for work in works:
                work.wait()

        return Handle(wait_all, on_done)

    def _count(self, kind: str, tensors: list[Tensor], key: GroupKey) -> None:
        size = sum(t.numel() * t.element_size() for t in tensors)
        self.sent_bytes[key[0]] += size if kind == "send" else ring_bytes(kind, size, len(self.members[key]))

    def send(self, tensor: Tensor, peer: int, key: GroupKey) -> Handle:
        self._count("send", [tensor], key)
        return self.call(key, lambda group: [dist.isend(tensor, self._process(peer), group=group)])

    def recv(self, buffer: Tensor, peer: int, key: GroupKey) -> Handle:
        return self.call(key, lambda group: [dist.irecv(buffer, self._process(peer), group=group)])

    def all_reduce(self, tensors: list[Tensor], key: GroupKey, on_done: Callable[[], None] | None = None) -> Handle:
        """Sum each tensor over the group, in place."""
        self._count("all_reduce", tensors, key)
        return self.call(key, lambda group: [dist.all_reduce(t, group=group, async_op=True) for t in tensors], on_done)

    def reduce(self, pairs: list[tuple[Tensor, int]], key: GroupKey) -> Handle:
        """Sum each tensor over the group into the copy of its global rank; the other members'
        copies are left undefined."""
        self._count("reduce", [t for t, _ in pairs], key)
        return self.call(
            key, lambda group: [dist.reduce(t, self._process(root), group=group, async_op=True) for t, root in pairs]
        )

    def broadcast(
        self, pairs: list[tuple[Tensor, int]], key: GroupKey, on_done: Callable[[], None] | None = None
    ) -> Handle:
        """Each tensor of the pair's global rank into that tensor of every member, in place: one
        broadcast per root, dtype and device (`coalesced`; every member must pass the same roots,
        shapes and dtypes in the same order), the received values copied in before `on_done`."""
        self._count("broadcast", [t for t, _ in pairs], key)
        batches = coalesced(pairs, self.rank)

        def start(group: dist.ProcessGroup) -> list:
            return [dist.broadcast(b.flat, self._process(b.root), group=group, async_op=True) for b in batches]

        def received() -> None:
            for batch in batches:
                batch.unpack()
            if on_done is not None:
                on_done()

        return self.call(key, start, received)

    def tensor_all_reduce(self, tensor: Tensor) -> Tensor:
        """Sum `tensor` over this rank's tensor-parallel processes, in place, and wait: the
        blocking all-reduce inside a forward or backward (in order, in the in-order mode)."""
        self._count("all_reduce", [tensor], TENSOR)
        self.call(TENSOR, lambda group: [dist.all_reduce(tensor, group=group, async_op=True)]).wait()
        return tensor
