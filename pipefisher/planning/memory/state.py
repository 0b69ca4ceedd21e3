"""Per-rank training-state memory and data-parallel gradient traffic of a pipelined run, in bytes.
Pure Python: no torch.

What is counted per rank, summed over the stages it holds (`Topology.stages_of`; Chimera and
interleaved ranks hold several):

- parameters and gradients: whole on every rank (pipefisher keeps fp32 master weights and fp32
  gradients whatever the precision; ZeRO-1 cuts neither). ZeRO-2/3 (FSDP2, on stages with more
  than one replica): the rank's shards at rest and at the optimizer step, plus at the step's
  peak the parameters FSDP2 holds gathered (ZeRO-2 the whole stage through the step, ZeRO-3 the
  root unit and two blocks while an op runs) and the whole unreduced gradient accumulated until
  the step's one reduce-scatter (`pipefisher.planning.memory.sharded`); `RankMemory.total_bytes`
  counts the peak (`peak_parameter_bytes`, `peak_gradient_bytes`), equal to the resting bytes
  for ZeRO 0 and 1;
- optimizer state: per parameter tensor the runtime's optimizer updates, i.e. every parameter of
  the rank's stages without ZeRO, the rank's own (`pipefisher.planning.replicas.zero.shard_owners`) with ZeRO-1,
  the rank's shard of every parameter with ZeRO-2/3; under a curvature method, the parameters it
  does not precondition (`StageState.preconditioned`) hold its `first_order` rule's state (`.rest`);
- curvature state: what the curvature method holds per layer once a refresh is committed (its
  memory model, `CurvatureLayer`; K-FAC's is `pipefisher.methods.kfac.memory`), for every layer of
  every held stage; with G gradient workers per layer (`pipefisher.planning.replicas.kaisa`) a rank
  keeps the refresh results only of the layers it works for;
- grad_comm_bytes: bytes the rank sends per step for its stages' gradient reduction over their
  replicas (ring model, `pipefisher.planning.comm.volume.ring_bytes`): an all-reduce without ZeRO; with
  ZeRO-1 a reduce to the owners plus the owners' parameter broadcast, the same volume; with
  ZeRO-2/3 FSDP2's reduce-scatter and all-gathers (once a step, ZeRO-2; every forward and
  backward, ZeRO-3); with PowerSGD an all-reduce of its P and Q factors and of the tensors it
  leaves whole (`powersgd_elements`); with gradient workers, plus the broadcasts of every
  layer's preconditioned gradient within a block of R/G replicas.

Tensor parallelism: give one tensor-parallel rank's `StageState`s (its shards of the split Linears,
the rest whole; `transformer_state` builds them for pipefisher's BERT): every figure is that rank's.

Not counted: activations, captures, built (unsynced) statistics, communication and temporary
buffers, allocator slack; traffic per bucket rounds (the runtime's: under 2 bytes a bucket off).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from pipefisher.core.topology import Topology
from pipefisher.planning.comm.volume import powersgd_elements, ring_bytes
from pipefisher.planning.memory.layer_model import CurvatureLayer
from pipefisher.planning.memory.sharded import sharded_stage
from pipefisher.planning.memory.zero_owned import owned_optimizer_bytes
from pipefisher.planning.replicas.kaisa import GradWorkers


@dataclass(frozen=True)
class StageState:
    """One stage's trainable parameters as element counts, each tensor once, in
    ``module.parameters()`` order (the order ZeRO-1 shards them in), the curvature method's
    layers, the parameters' shapes in the same order (PowerSGD's traffic needs them) and whether
    the curvature method preconditions each (empty: every one); `blocks`: element counts of the
    stage's repeated blocks, FSDP2's units under ZeRO-3 (empty: the stage is one unit)."""

    parameters: tuple[int, ...]
    curvature_layers: tuple[CurvatureLayer, ...] = ()
    shapes: tuple[tuple[int, ...], ...] = ()
    preconditioned: tuple[bool, ...] = ()
    blocks: tuple[int, ...] = ()

    def preconditions(self, index: int) -> bool:
        """Whether the curvature method preconditions parameter `index`."""
        return not self.preconditioned or self.preconditioned[index]

    @property
    def numel(self) -> int:
        return sum(self.parameters)


@dataclass(frozen=True)
class OptimizerState:
    """What an optimizer keeps per parameter tensor: ``bytes_per_element`` × numel plus
    ``bytes_per_tensor``; ``curvature``: a curvature method preconditions the gradients first
    (its state is counted as curvature state, from the stages' `curvature_layers`); ``rest``: the
    state of the parameters it does not precondition (None: the same as the others')."""

    name: str
    bytes_per_element: int
    bytes_per_tensor: int = 0
    curvature: bool = False
    rest: OptimizerState | None = None

    def tensor_bytes(self, numel: int, preconditioned: bool = True) -> int:
        """Bytes kept for a parameter of `numel` elements; `preconditioned`: by the curvature method."""
        if not preconditioned and self.rest is not None:
            return self.rest.tensor_bytes(numel)
        return self.bytes_per_element * numel + self.bytes_per_tensor


def optimizer_state(
    name: str, momentum: float = 0.0, element_bytes: int = 4, first_order: str = "adamw", memory: str | None = None
) -> OptimizerState:
    """The state of pipefisher's optimizer `name` (`optimizer.name`) over parameters of
    `element_bytes` each: SGD a momentum buffer when momentum > 0 (also after a curvature
    method; `memory`: when `name` is one, its memory model, `CurvatureMethod.memory`, which must
    be declared: ValueError when it is ""; the parameters it does not precondition keep the state
    of its `first_order` rule, that SGD's for sgd); torch AdamW two moments and a 0-dim fp32 step
    tensor; pipefisher's LAMB two moments (its step is a Python int)."""
    if name == "sgd":
        return OptimizerState(name, element_bytes if momentum > 0 else 0)
    if memory is not None:
        if not memory:
            raise ValueError(f"optimizer {name!r}: the method declares no memory model (CurvatureMethod.memory)")
        rest = None if first_order == "sgd" else optimizer_state(first_order, element_bytes=element_bytes)
        return OptimizerState(name, element_bytes if momentum > 0 else 0, curvature=True, rest=rest)
    if name == "adamw":
        return OptimizerState(name, 2 * element_bytes, bytes_per_tensor=4)
    if name == "lamb":
        return OptimizerState(name, 2 * element_bytes)
    raise ValueError(f"optimizer {name!r}: the memory model knows sgd, adamw, lamb and the curvature methods")


@dataclass(frozen=True)
class ElementBytes:
    """Bytes per element of parameters, gradients and curvature statistics (fp32 by default, as
    the runtime keeps them)."""

    parameter: int = 4
    gradient: int = 4
    factor: int = 4


@dataclass(frozen=True)
class StageMemory:
    """One stage copy's share of a rank's bytes; `replicas`: ranks holding the stage (R).
    `parameter_bytes` and `gradient_bytes` are held at the optimizer step; ZeRO-2/3 also hold, in
    the step, `gathered_bytes` of whole parameters beside their shards (`gathered_per_op`: only
    while one of the stage's ops runs) and `unreduced_bytes` of whole gradient (0: none);
    `worker_bytes`: the part of `grad_comm_bytes` that gradient workers' broadcasts of
    preconditioned gradients send (``pgrad``; 0: none)."""

    pipe: int
    stage: int
    replicas: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    curvature_bytes: int
    grad_comm_bytes: int
    compression_bytes: int = 0
    gathered_bytes: int = 0
    gathered_per_op: bool = False
    unreduced_bytes: int = 0
    worker_bytes: int = 0


@dataclass(frozen=True)
class RankMemory:
    """A rank's training-state bytes and per-step gradient traffic (bytes sent), summed over the
    stage copies it holds (`stages`)."""

    rank: int
    stages: tuple[StageMemory, ...]

    def _sum(self, field: str) -> int:
        return sum(getattr(part, field) for part in self.stages)

    @property
    def parameter_bytes(self) -> int:
        return self._sum("parameter_bytes")

    @property
    def gradient_bytes(self) -> int:
        return self._sum("gradient_bytes")

    @property
    def optimizer_bytes(self) -> int:
        return self._sum("optimizer_bytes")

    @property
    def curvature_bytes(self) -> int:
        return self._sum("curvature_bytes")

    @property
    def grad_comm_bytes(self) -> int:
        return self._sum("grad_comm_bytes")

    @property
    def compression_bytes(self) -> int:
        return self._sum("compression_bytes")

    @property
    def peak_parameter_bytes(self) -> int:
        """Parameter bytes at the step's peak: the resting ones, the gathered ones held through the
        step (ZeRO-2) and the most any one op gathers (ZeRO-3)."""
        held = sum(part.gathered_bytes for part in self.stages if not part.gathered_per_op)
        per_op = max((part.gathered_bytes for part in self.stages if part.gathered_per_op), default=0)
        return self.parameter_bytes + held + per_op

    @property
    def peak_gradient_bytes(self) -> int:
        """Gradient bytes at the step's peak: per stage the whole unreduced gradient (ZeRO-2/3)
        or the held one, whichever is more."""
        return sum(max(part.gradient_bytes, part.unreduced_bytes) for part in self.stages)

    @property
    def total_bytes(self) -> int:
        """Parameters + gradients at their peak + optimizer state + curvature state + PowerSGD's
        state (traffic excluded)."""
        return (
            self.peak_parameter_bytes
            + self.peak_gradient_bytes
            + self.optimizer_bytes
            + self.curvature_bytes
            + self.compression_bytes
        )


def rank_memory(
    topology: Topology,
    stages: Sequence[StageState],
    optimizer: OptimizerState,
    zero: int = 0,
    widths: ElementBytes = ElementBytes(),
    workers_per_layer: int | None = None,
    powersgd_rank: int = 0,
) -> tuple[RankMemory, ...]:
    """Every global rank's bytes (index = rank) for `stages` (one per stage index of the schedule)
    placed by `topology`; `zero` 0 (off), 1 (optimizer state sharded by parameter over each
    stage's replicas, `shard_owners`), 2 or 3 (FSDP2, `pipefisher.planning.memory.sharded`);
    `workers_per_layer`: K-FAC's G gradient workers per layer (None:
    every replica); `powersgd_rank`: PowerSGD's rank (0 = off; needs the stages' shapes)."""
    if len(stages) != topology.schedule.num_stages:
        raise ValueError(f"stages: {len(stages)} given, the schedule has {topology.schedule.num_stages}")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero: {zero} is not a ZeRO stage; use 0, 1, 2 or 3")
    if powersgd_rank and any(len(stage.shapes) != len(stage.parameters) for stage in stages):
        raise ValueError("powersgd_rank: the stages' parameter shapes are needed (StageState.shapes)")
    replica_ranks = [topology.replica_ranks(index) for index in range(len(stages))]
    #: per stage, its optimizer bytes per owning rank (ZeRO-1), else None: every copy holds all
    owned: list[dict[int, int] | None] = [
        owned_optimizer_bytes(stage, optimizer, replica_ranks[index]) if zero == 1 else None
        for index, stage in enumerate(stages)
    ]
    copies: dict[tuple[int, int, int], StageMemory] = {}  # (pipe, stage, rank or -1: any) -> its bytes
    owning: dict[tuple[int, int, int], StageMemory] = {}  # (pipe, stage, optimizer bytes, -1: all) -> a copy

    def shared_copy(pipe: int, index: int, rank: int, mine: dict[int, int] | None) -> StageMemory:
        """The copy of a stage whose ranks differ only in the optimizer bytes they own (ZeRO-1)."""
        shared = copies.get((pipe, index, -1))
        if shared is None:
            shared = copies[(pipe, index, -1)] = _stage_copy(
                topology, stages[index], optimizer, zero, widths, powersgd_rank, (pipe, index, rank),
                replica_ranks[index], None, None,
            )  # fmt: skip
        own = (pipe, index, -1 if mine is None else mine.get(rank, 0))
        if own not in owning:
            owning[own] = shared if mine is None else replace(shared, optimizer_bytes=own[2])
        return owning[own]

    held = [topology.stages_of(rank) for rank in range(topology.pipeline_ranks)]  # each replica holds the same
    result = []
    for rank in range(topology.world_size):
        parts = []
        for pipe, index in held[topology.pipeline_rank(rank)]:
            ranks = replica_ranks[index]
            grid = (
                GradWorkers(ranks, workers_per_layer)
                if workers_per_layer is not None and workers_per_layer < len(ranks)
                else None
            )
            mine = owned[index]
            key = (pipe, index, rank if grid is not None or mine is not None else -1)
            if key not in copies:
                copies[key] = shared_copy(pipe, index, rank, mine) if grid is None else _stage_copy(
                    topology, stages[index], optimizer, zero, widths, powersgd_rank, (pipe, index, rank),
                    ranks, grid, None if mine is None else mine.get(rank, 0),
                )  # fmt: skip
            parts.append(copies[key])
        result.append(RankMemory(rank, tuple(parts)))
    return tuple(result)


def _stage_copy(
    topology: Topology,
    stage: StageState,
    optimizer: OptimizerState,
    zero: int,
    widths: ElementBytes,
    powersgd_rank: int,
    where: tuple[int, int, int],
    ranks: tuple[int, ...],
    grid: GradWorkers | None,
    owned_bytes: int | None,
) -> StageMemory:
    """`rank_memory`'s bytes of one copy of `stage` at `where` (pipe, stage index, rank), held by
    `ranks`; `owned_bytes`: the optimizer bytes of the parameters the rank owns (ZeRO-1), None:
    it keeps all."""
    pipe, index, rank = where
    replicas = len(ranks)
    gradient_bytes = stage.numel * widths.gradient
    parameter_bytes = stage.numel * widths.parameter
    if zero == 1:  # reduce-scatter to the owners, then the owners' all-gather of parameters
        traffic = ring_bytes("reduce", gradient_bytes, replicas) + ring_bytes("broadcast", parameter_bytes, replicas)
    elif powersgd_rank:
        elements = sum(powersgd_elements(shape, powersgd_rank) for shape in stage.shapes)
        traffic = ring_bytes("all_reduce", elements * widths.gradient, replicas)
    else:
        traffic = ring_bytes("all_reduce", gradient_bytes, replicas)
    compression = (
        powersgd_state_bytes(stage.shapes, powersgd_rank, widths.gradient) if powersgd_rank and not zero else 0
    )
    optimizer_bytes = (
        sum(optimizer.tensor_bytes(numel, stage.preconditions(number)) for number, numel in enumerate(stage.parameters))
        if owned_bytes is None
        else owned_bytes
    )
    gathered, per_op, unreduced = 0, False, 0
    pipes = topology.schedule.num_pipes
    if zero > 1 and replicas > 1:  # FSDP2 wraps replicated stages only, over a pipe's copies
        sharded = sharded_stage(
            stage.parameters,
            stage.shapes,
            stage.blocks,
            replicas // pipes,
            zero,
            topology.schedule.num_micro_batches,
            widths.parameter,
            widths.gradient,
        )
        parameter_bytes, gradient_bytes, traffic = (
            sharded.parameter_bytes,
            sharded.gradient_bytes,
            # Chimera: each shard then summed over the pipes (``grad_pipes``)
            sharded.traffic + ring_bytes("all_reduce", sharded.gradient_bytes, pipes),
        )
        optimizer_bytes = sum(
            optimizer.tensor_bytes(shard, stage.preconditions(number)) for number, shard in enumerate(sharded.shards)
        )
        gathered, per_op, unreduced = sharded.gathered_bytes, sharded.per_op, sharded.unreduced_bytes
    curvature = worker_bytes = 0
    if optimizer.curvature:
        curvature = sum(
            layer.state_bytes(widths.factor, grid is None or grid.works_for(rank, number))
            for number, layer in enumerate(stage.curvature_layers)
        )
        if grid is not None:  # each layer's preconditioned gradient
            worker_bytes = sum(
                ring_bytes("broadcast", layer.gradient_elements * widths.gradient, grid.block_size)
                for layer in stage.curvature_layers
            )
            traffic += worker_bytes
    return StageMemory(
        pipe,
        index,
        replicas,
        parameter_bytes,
        gradient_bytes,
        optimizer_bytes,
        curvature,
        traffic,
        compression,
        gathered,
        per_op,
        unreduced,
        worker_bytes,
    )


def powersgd_state_bytes(shapes: Sequence[tuple[int, ...]], rank: int, element_bytes: int = 4) -> int:
    """What PowerSGD keeps for a stage (`pipefisher.runtime.gradient_path.powersgd`, fp32 gradients): the error
    of every matrix it compresses (its size), the Q factors (m x r each), and the P factors with a
    copy of every tensor it leaves whole (n x r each, plus those tensors)."""
    elements = 0
    for shape in shapes:
        numel = math.prod(shape)
        if powersgd_elements(shape, rank) < numel:
            elements += numel + rank * (numel // shape[0]) + rank * shape[0]
        else:
            elements += numel
    return elements * element_bytes


def largest(ranks: Sequence[RankMemory], field: str) -> int:
    """The largest value of `field` (a RankMemory property, e.g. ``total_bytes``) over `ranks`."""
    return max(getattr(rank, field) for rank in ranks)
