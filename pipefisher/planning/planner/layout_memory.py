"""Bytes per rank of a layout: training state (parameters, gradients, optimizer and curvature
state, PowerSGD's; `pipefisher.planning.memory.state.rank_memory` over the model's
`transformer_stage_states`) plus activations held at the schedule's peak (`layout_memory`); for a
packed curvature plan, the joint peak over its refresh cycle of activations, captures and the
refresh's copies of the statistics (`packed_memory`, `pipefisher.planning.memory.cycle`, which
counts a captured input once: as an activation until its backward, as a capture after) and what
its help ops hold (`pipefisher.planning.memory.helped`). The method's layers are modelled at what
its run-file section sets of them (`layer_models.layer_settings`). Pure Python: no torch.

Activations: `pipefisher.planning.memory.activations` (what autograd saves per micro-batch, held
from each forward to its backward, or its weight gradient under a split backward, at the
schedule's peak) and the point-to-point buffers (`pipefisher.planning.memory.peak`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache, partial

from pipefisher.core.profile import Profile
from pipefisher.core.topology import Topology
from pipefisher.methods.registry import methods
from pipefisher.planning.planner.candidates import Layout
from pipefisher.planning.planner.layer_models import (
    LayerSettings,
    layer_memory_model,
    profile_layers,
    step_momentum,
)
from pipefisher.planning.memory.activations import activation_peaks
from pipefisher.planning.planner.model_sizes import ModelSizes
from pipefisher.planning.memory.state import OptimizerState, RankMemory, optimizer_state, rank_memory
from pipefisher.planning.memory.cycle import cycle_peaks
from pipefisher.planning.memory.helped import help_bytes_per_rank
from pipefisher.planning.memory.layer_model import refresh_copies, refresh_work
from pipefisher.planning.memory.peak import (
    comm_buffer_bytes,
    rank_cast_bytes,
    stage_activation_bytes,
    stage_sent_bytes,
)
from pipefisher.planning.plan import Plan
from pipefisher.planning.memory.transformer_state import TransformerSizes, transformer_stage_states

#: memory a GPU holds back outside the model, GiB (`default_reserve_gib`): the CUDA context with
#: its kernels and cuBLAS/cuDNN workspaces (PyTorch's context alone shows ~0.8 GB in nvidia-smi,
#: pytorch/pytorch#34323) and NCCL's buffers (NCCL_BUFFSIZE, 4 MiB per channel and peer)
RESERVE_FIXED_GIB = 1.0
#: the caching allocator's slack (reserved beyond the live bytes: rounding, fragmentation) as a
#: share of the GPU's memory; a rule of thumb, not a measurement of this project's runs
RESERVE_SHARE = 0.05


def default_reserve_gib(memory_gib: float) -> float:
    """The memory reserve of a GPU of `memory_gib` GiB (GiB): `RESERVE_FIXED_GIB` plus
    `RESERVE_SHARE` of the memory. The planner ranks no layout that needs more than the memory
    less the reserve (`pipefisher plan --reserve-gb` sets it)."""
    return RESERVE_FIXED_GIB + RESERVE_SHARE * memory_gib


@dataclass(frozen=True)
class MemoryUse:
    """Bytes of the rank with the most (`rank`): its training state (for a packed plan with what
    its help ops hold for the cycle), activations (with the point-to-point buffers) and, for a
    packed plan, its captures and the refresh's copies of the statistics, the last two at their
    joint peak with the activations; `total` their sum."""

    rank: int
    state: int
    activations: int
    captures: int = 0

    @property
    def total(self) -> int:
        return self.state + self.activations + self.captures


def _optimizer(method: str, first_order: str, momentum: float) -> OptimizerState:
    """The optimizer state of `method`; a curvature method without a memory model keeps its
    first-order rule's state (its own state is not counted)."""
    if method in methods() and layer_memory_model(method) is None:
        return optimizer_state(first_order)
    known = methods().get(method)
    memory = known.memory if known else None
    return optimizer_state(method, step_momentum(method, momentum), first_order=first_order, memory=memory)


@lru_cache(maxsize=256)
def _stage_states(
    sizes: ModelSizes,
    pieces: int,
    tensor_parallel: int,
    method: str,
    stage_blocks: tuple[int, ...],
    settings: LayerSettings = (),
):
    model = layer_memory_model(method)
    transformer = TransformerSizes(
        sizes.blocks, sizes.hidden, sizes.ffn, sizes.vocab, max_positions=max(512, sizes.seq_len)
    )
    return transformer_stage_states(
        transformer,
        pieces,
        partial(model.from_linear, **dict(settings)) if model else None,
        tensor_parallel=tensor_parallel,
        preconditions_bias=bool(model and model.PRECONDITIONS_BIAS),
        stage_blocks=stage_blocks,
    )


def stage_parameters(layout: Layout, sizes: ModelSizes) -> tuple[int, ...]:
    """Parameter elements of each of the layout's pieces (stage index), on tensor-parallel rank 0."""
    return tuple(
        state.numel
        for state in _stage_states(sizes, layout.pieces, layout.tensor_parallel, layout.method, layout.stage_blocks)
    )


_STATES: dict[tuple, tuple[RankMemory, ...]] = {}
_HEAVIEST: dict[tuple, tuple[tuple[int, int], ...]] = {}


@dataclass(frozen=True)
class StateInputs:
    """What a layout's training state depends on beside the layout: the model, the first-order
    rule and SGD momentum, gradient workers per layer (`PlanContext.workers_per_layer`; None:
    every replica) and the method's layer settings (`layer_settings`)."""

    sizes: ModelSizes
    first_order: str
    momentum: float
    workers: int | None = None
    settings: LayerSettings = ()


def _replica_key(layout: Layout, state: StateInputs) -> tuple:
    """What the state depends on beside the schedule: replicas, gradient path, method, `state`."""
    powersgd = 0 if layout.zero else layout.powersgd_rank
    return (layout.data_parallel, layout.tensor_parallel, layout.zero, powersgd, layout.method, state)


def state_per_rank(
    layout: Layout,
    sizes: ModelSizes,
    first_order: str,
    momentum: float,
    workers: int | None = None,
    settings: LayerSettings = (),
) -> tuple[RankMemory, ...]:
    """Every rank's training state under `layout` (its method, ZeRO 1-3, PowerSGD, `workers`
    gradient workers per layer: `PlanContext.workers_per_layer`), shard 0 of tensor parallelism
    (the largest), the method's layers at `settings` (`layer_settings`)."""
    return _states(layout, StateInputs(sizes, first_order, momentum, workers, settings))


def _states(layout: Layout, state: StateInputs) -> tuple[RankMemory, ...]:
    """`state_per_rank`, cached on what it depends on: the schedule's shape and `_replica_key`
    (not the micro-batches)."""
    key = (layout.schedule, layout.stages, layout.chunks, layout.stage_blocks, *_replica_key(layout, state))
    if key not in _STATES:
        powersgd = 0 if layout.zero else layout.powersgd_rank
        stages = _stage_states(
            state.sizes, layout.pieces, layout.tensor_parallel, layout.method, layout.stage_blocks, state.settings
        )
        topology = Topology(layout.build_schedule(), layout.data_parallel, layout.tensor_parallel)
        optimizer = _optimizer(layout.method, state.first_order, state.momentum)
        _STATES[key] = rank_memory(
            topology, stages, optimizer, int(layout.zero), workers_per_layer=state.workers, powersgd_rank=powersgd
        )
    return _STATES[key]


def _placement_key(layout: Layout, state: StateInputs) -> tuple:
    """What the ranks' state bytes (`RankMemory.total_bytes`) depend on: `_states`' key with the
    schedule named by what `rank_memory` reads of it, its ranks, pipes, stages and placement (not
    its op order: GPipe, 1F1B and ZB-H1 on one shape share it; the micro-batches change the
    traffic of ZeRO-2/3, never the bytes)."""
    schedule = layout.build_schedule()
    placement = tuple(sorted(schedule.placement.items()))
    shape = (schedule.num_ranks, schedule.num_pipes, schedule.num_stages, placement, layout.stage_blocks)
    return (shape, *_replica_key(layout, state))


def _heaviest_states(layout: Layout, state: StateInputs) -> tuple[tuple[int, int], ...]:
    """Per pipeline position (ranks equal modulo the pipeline's), (the lowest rank of the most
    state bytes there, those bytes), by rank: the ranks at a position share their activations,
    so the rank with the most bytes overall is one of these (the lowest of ties, as a scan over
    every rank finds). Cached on `_placement_key`."""
    key = _placement_key(layout, state)
    if key not in _HEAVIEST:
        pipeline = layout.build_schedule().num_ranks
        best: dict[int, tuple[int, int]] = {}
        totals: dict[tuple[int, ...], int] = {}  # by the identity of a rank's stage copies (shared by ranks)
        for rank, memory in enumerate(_states(layout, state)):
            parts = tuple(map(id, memory.stages))
            total = totals.get(parts)
            if total is None:
                total = totals[parts] = memory.total_bytes
            held = best.get(rank % pipeline)
            if held is None or total > held[1]:
                best[rank % pipeline] = (rank, total)
        _HEAVIEST[key] = tuple(sorted(best.values()))
    return _HEAVIEST[key]


def activation_per_rank(layout: Layout, sizes: ModelSizes, precision: str = "fp32") -> tuple[int, ...]:
    """Per rank of one pipeline, activation bytes at the schedule's peak
    (`pipefisher.planning.memory.activations.activation_peaks`, with each backward's transient
    bytes) plus its point-to-point buffers (`comm_buffer_bytes`) and, without FSDP (ZeRO-0/1),
    the step's one low-precision copy of its weights (`rank_cast_bytes`). Cached on the pipeline
    and whether FSDP casts per micro-batch (layouts that differ otherwise in data parallelism,
    gradient path or method share it)."""
    fsdp = 2 if layout.zero >= 2 else 0
    pipeline = replace(layout, data_parallel=1, zero=fsdp, powersgd_rank=0, method="", refresh_steps=0)
    return _pipeline_activations(pipeline, sizes, precision)


@lru_cache(maxsize=4096)
def _pipeline_activations(layout: Layout, sizes: ModelSizes, precision: str) -> tuple[int, ...]:
    """`activation_per_rank` of a layout reduced to its pipeline and its casts (`layout.zero` 0 or 2)."""
    schedule = layout.build_schedule()
    shape = replace(sizes.shape, stage_blocks=layout.stage_blocks)
    step_cache = layout.zero < 2  # the runtime casts per micro-batch under ZeRO-2/3
    kept, pending, transient = stage_activation_bytes(
        shape, layout.pieces, layout.micro_batch_size, precision, layout.recompute, layout.tensor_parallel, step_cache
    )
    sent = stage_sent_bytes(shape, layout.pieces, layout.micro_batch_size, precision)
    peaks = activation_peaks(schedule, kept, pending, transient, sent)
    topology = Topology(schedule)
    return tuple(
        peak
        + comm_buffer_bytes(topology, rank, shape, layout.micro_batch_size, precision)
        + rank_cast_bytes(topology, rank, shape, precision, layout.tensor_parallel, step_cache)
        for rank, peak in enumerate(peaks)
    )


def layout_memory(
    layout: Layout,
    sizes: ModelSizes,
    first_order: str,
    momentum: float,
    precision: str = "fp32",
    workers: int | None = None,
    settings: LayerSettings = (),
) -> MemoryUse:
    """The rank with the most bytes before any curvature plan: state + activations (the first of
    ties, by rank; over `_heaviest_states`' ranks); `workers`: as `state_per_rank`."""
    activations = activation_per_rank(layout, sizes, precision)
    pipeline = len(activations)
    return max(
        (
            MemoryUse(rank, total, activations[rank % pipeline])
            for rank, total in _heaviest_states(layout, StateInputs(sizes, first_order, momentum, workers, settings))
        ),
        key=lambda found: found.total,
    )


def packed_memory(
    layout: Layout,
    sizes: ModelSizes,
    first_order: str,
    momentum: float,
    precision: str,
    plan: Plan,
    profile: Profile,
    workers: int | None = None,
    settings: LayerSettings = (),
) -> MemoryUse:
    """The rank with the most bytes under a packed curvature plan: its state (`workers`,
    `settings`: as `state_per_rank`; `layer_settings` of whether `plan` has P ops) with what its
    help ops hold for the cycle (`help_bytes_per_rank`), and the joint peak over the plan's
    refresh cycle of activations, captures and refresh copies (`cycle_peaks`), plus its
    point-to-point buffers. The ranks at one pipeline position share all but their state, so the
    rank is one of `_heaviest_states`'."""
    shape = replace(sizes.shape, stage_blocks=layout.stage_blocks)
    step_cache = layout.zero < 2
    kept, pending, transient = stage_activation_bytes(
        shape, layout.pieces, layout.micro_batch_size, precision, layout.recompute, layout.tensor_parallel, step_cache
    )
    sent = stage_sent_bytes(shape, layout.pieces, layout.micro_batch_size, precision)
    layers = profile_layers(layout.method, layout.tensor_parallel, sizes, profile, settings)
    joint = cycle_peaks(plan, profile, kept, pending, transient, refresh_copies(layers), sent, refresh_work(layers))
    buffers = _buffer_bytes(layout, sizes, precision, Topology(plan.schedule))
    helped = help_bytes_per_rank(plan, layers)
    pipeline = len(joint)

    def use(rank: int, state: int) -> MemoryUse:
        peak, position = joint[rank % pipeline], rank % pipeline
        return MemoryUse(
            rank,
            state + helped[position],
            peak.activation_bytes + buffers[position],
            peak.capture_bytes + peak.refresh_bytes,
        )

    heaviest = _heaviest_states(layout, StateInputs(sizes, first_order, momentum, workers, settings))
    return max((use(rank, state) for rank, state in heaviest), key=lambda found: found.total)


def refresh_floor(
    layout: Layout,
    sizes: ModelSizes,
    first_order: str,
    momentum: float,
    precision: str,
    profile: Profile,
    workers: int | None = None,
    settings: LayerSettings = (),
) -> MemoryUse:
    """A lower bound of `packed_memory` under every plan of a curvature method: each layer of a
    rank's stages starts its refresh copy at its first curvature task of the cycle (a method
    without them: its first refresh or exchange op) and holds it to the cycle's commit
    (`cycle_peaks`); every layer refreshes once a cycle, so at the rank's last op it holds all of
    them beside its state and buffers. The rank where that sum
    is largest, its refresh copies as `captures`; no copies for a method without a memory model.
    `profile`: the layout's (its layer names per stage). The ranks at one pipeline position hold
    the same copies and buffers, so the rank is one of `_heaviest_states`'."""
    schedule = layout.build_schedule()
    topology = Topology(schedule)
    buffers = _buffer_bytes(layout, sizes, precision, topology)
    refresh = refresh_copies(profile_layers(layout.method, layout.tensor_parallel, sizes, profile, settings))
    stages: list[set[int]] = [set() for _ in range(schedule.num_ranks)]
    for (_, stage), rank in schedule.placement.items():
        stages[rank].add(stage)  # a stage held in two pipes copies its statistics once
    held = [sum(refresh.get((s, layer.name), 0) for s in own for layer in profile.stages[s].layers) for own in stages]
    pipeline = len(held)
    return max(
        (
            MemoryUse(rank, total, buffers[rank % pipeline], held[rank % pipeline])
            for rank, total in _heaviest_states(layout, StateInputs(sizes, first_order, momentum, workers, settings))
        ),
        key=lambda found: found.total,
    )


def _buffer_bytes(layout: Layout, sizes: ModelSizes, precision: str, topology: Topology) -> list[int]:
    """Per rank of one pipeline, its point-to-point buffers (`comm_buffer_bytes`) and, without
    FSDP, the step's low-precision copy of its weights (`rank_cast_bytes`)."""
    shape = replace(sizes.shape, stage_blocks=layout.stage_blocks)
    step_cache = layout.zero < 2
    return [
        comm_buffer_bytes(topology, rank, shape, layout.micro_batch_size, precision)
        + rank_cast_bytes(topology, rank, shape, precision, layout.tensor_parallel, step_cache)
        for rank in range(topology.schedule.num_ranks)
    ]
