"""The gradient path's strategies: how a replicated stage's gradient is reduced over its replicas
at the end of a step, one class per `Reduction` of the run's `GradientPath`, chosen once by
`gradient_reduction`.

A strategy issues the collectives the communication plan names for the gradient path
(``grad``, PowerSGD's ``grad_q``, ZeRO-1's ``gather``; `pipefisher.planning.comm.plan`), on the
stage's gradient buffers, and nothing else: the order they are issued in is the plan's, checked
by the replay against NCCL's in-order rule. `StepEnd` calls it only on steps that update.

A new strategy (e.g. ZeRO-2/3's `pipefisher.runtime.gradient_path.sharded`) implements `GradientReduction`:

- `launch_grad` (required): the stage's reduction, returning its handle;
- `launch_grad_q` / `launch_gather`: the second reduction / the owners' parameter broadcast
  after the optimizer step, when its plan has them (default: nothing);
- `state_dict` / `load_state_dict` / `tensors`: state kept between steps, for checkpoints
  (entries ``local/<process>/<section>/<stage>``) and the state-bytes report (default: none);
- `reduce_now`: the whole path at once for the profiler (default: the three launches in order);
- `scale_` / `zero_`: clip / clear gradients it holds outside the buffers (default: none);

then adds its `Reduction` to `pipefisher.planning.comm.actions`, its collectives to the plan,
and a line to `gradient_reduction`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from torch import Tensor

from pipefisher.core.topology import Topology
from pipefisher.planning.comm.actions import (
    Collective,
    GradientPath,
    Reduction,
    gather_collective,
    grad_collective,
    grad_q_collective,
)
from pipefisher.runtime.gradient_path.buffers import GradientBuffer
from pipefisher.runtime.gradient_path.powersgd import PowerSGD
from pipefisher.runtime.primitives.comm import Comm, Handle, done

#: (pipe, stage) -> a stage's gradient buffer on this rank
Buffers = dict[tuple[int, int], GradientBuffer]


class GradientReduction(ABC):
    """How this rank's stages' gradients (`buffers`) are reduced over their replicas."""

    #: the checkpoint section of its per-stage state (`state_dict`)
    section: str = ""

    def __init__(self, buffers: Buffers):
        self.buffers = buffers

    def stage_buffers(self, stage: int) -> list[GradientBuffer]:
        return [buffer for (pipe, s), buffer in self.buffers.items() if s == stage]

    @abstractmethod
    def launch_grad(self, comm: Comm, collective: Collective, step: int) -> Handle:
        """Start the reduction of stage `collective.key[0]`'s gradient in step `step` (0-based)."""

    def launch_grad_q(self, comm: Comm, collective: Collective, step: int) -> Handle:
        """A second reduction, launched once the first is in (PowerSGD's Q factors)."""
        return done()

    def launch_gather(self, comm: Comm, collective: Collective) -> Handle:
        """After the optimizer step: the updated parameters back to every replica (ZeRO-1)."""
        return done()

    def launch_grad_pipes(self, comm: Comm, collective: Collective) -> Handle:
        """ZeRO-2/3 with several pipes: the gradient shards summed over the stage's pipes."""
        return done()

    def reduce_now(self, comm: Comm, stage: int, step: int) -> None:
        """Stage `stage`'s whole gradient path at once, outside a plan's actions (the profiler)."""
        self.launch_grad(comm, grad_collective(stage), step).wait()
        self.launch_grad_q(comm, grad_q_collective(stage), step).wait()
        self.launch_gather(comm, gather_collective(stage)).wait()

    def scale_(self, coefficient: Tensor) -> None:
        """Multiply the gradients it holds outside `buffers` by `coefficient` (clipping)."""
        return None

    def zero_(self) -> None:
        """Clear the gradients it holds outside `buffers` (the end of a step)."""
        return None

    def state_dict(self) -> dict[tuple[int, int], dict]:
        """(pipe, stage) -> the state it keeps between steps (checkpoints)."""
        return {}

    def load_state_dict(self, states: dict[tuple[int, int], dict]) -> None:
        """Restore what `state_dict` returned (every key of it)."""
        assert not states, "a strategy with state restores it"

    def tensors(self) -> list[Tensor]:
        """Everything it keeps between and within steps (the state-bytes report)."""
        return []


class AllReduce(GradientReduction):
    """Every replica gets the whole sum: one all-reduce of the stage's buckets."""

    def launch_grad(self, comm: Comm, collective: Collective, step: int) -> Handle:
        return comm.all_reduce(
            [bucket for buffer in self.stage_buffers(collective.key[0]) for bucket in buffer.buckets], collective.group
        )


class ShardedReduction(AllReduce):
    """ZeRO-1 (the buffers have owners): each bucket is reduced to its owner, whose optimizer holds
    only what it owns; after the step every owner broadcasts its updated parameters (``gather``)."""

    def launch_grad(self, comm: Comm, collective: Collective, step: int) -> Handle:
        buffers = self.stage_buffers(collective.key[0])
        if not (buffers and buffers[0].owners is not None):
            return super().launch_grad(comm, collective, step)
        return comm.reduce(
            [(b, owner) for buffer in buffers for b, owner in zip(buffer.buckets, buffer.bucket_owners)],
            collective.group,
        )

    def launch_gather(self, comm: Comm, collective: Collective) -> Handle:
        buffers = self.stage_buffers(collective.key[0])
        return comm.broadcast(
            [(b, owner) for buffer in buffers for b, owner in zip(buffer.parameter_buckets, buffer.bucket_owners)],
            collective.group,
        )


class CompressedReduction(AllReduce):
    """PowerSGD (`pipefisher.runtime.gradient_path.powersgd`) on the replicated stages, from step
    `start` on: the P factors (``grad``), then the Q factors and the decompression (``grad_q``);
    an all-reduce of the buckets before `start` and on an unreplicated stage."""

    section = "powersgd"

    def __init__(self, buffers: Buffers, compressors: dict[tuple[int, int], PowerSGD], start: int):
        super().__init__(buffers)
        self.compressors, self.start = compressors, start

    def _compressors(self, stage: int, step: int) -> list[PowerSGD]:
        if step < self.start:
            return []
        return [compressor for (pipe, s), compressor in self.compressors.items() if s == stage]

    def launch_grad(self, comm: Comm, collective: Collective, step: int) -> Handle:
        compressors = self._compressors(collective.key[0], step)
        if not compressors:
            return super().launch_grad(comm, collective, step)
        return comm.all_reduce(
            [tensor for compressor in compressors for tensor in compressor.p_factors()], collective.group
        )

    def launch_grad_q(self, comm: Comm, collective: Collective, step: int) -> Handle:
        compressors = self._compressors(collective.key[0], step)
        if not compressors:
            return done()
        factors = [tensor for compressor in compressors for tensor in compressor.q_factors()]

        def decompress() -> None:
            for compressor in compressors:
                compressor.decompress()

        return comm.all_reduce(factors, collective.group, on_done=decompress)

    def reduce_now(self, comm: Comm, stage: int, step: int) -> None:
        """As from the start step on (the caller keeps and restores the state)."""
        super().reduce_now(comm, stage, max(step, self.start))

    def state_dict(self) -> dict[tuple[int, int], dict]:
        return {key: compressor.state_dict() for key, compressor in self.compressors.items()}

    def load_state_dict(self, states: dict[tuple[int, int], dict]) -> None:
        for key, compressor in self.compressors.items():
            compressor.load_state_dict(states[key])

    def tensors(self) -> list[Tensor]:
        return [tensor for compressor in self.compressors.values() for tensor in compressor.tensors()]


def gradient_reduction(
    path: GradientPath,
    topology: Topology,
    buffers: Buffers,
    powersgd_rank: int = 0,
    powersgd_start: int = 0,
    seed: int = 0,
    loss_scale: Callable[[], Tensor | None] = lambda: None,
) -> GradientReduction:
    """The strategy of `path.reduction` for this rank's `buffers` (ZeRO-1's buffers are built with
    owners). PowerSGD: rank `powersgd_rank` from step `powersgd_start`, its Q drawn from `seed`."""
    if path.reduction is Reduction.SHARDED:
        return ShardedReduction(buffers)
    if path.reduction is Reduction.COMPRESSED:
        compressors = {
            key: PowerSGD(buffer, powersgd_rank, seed=seed * 1009 + key[1], loss_scale=loss_scale)
            for key, buffer in buffers.items()
            if powersgd_rank and len(topology.replica_ranks(key[1])) > 1
        }
        return CompressedReduction(buffers, compressors, powersgd_start)
    return AllReduce(buffers)
