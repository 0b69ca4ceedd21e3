"""Bytes per rank of a layout: training state (parameters, gradients, optimizer and curvature
state, PowerSGD's; `pipefisher.planning.memory.rank_memory` over the model's
`transformer_stage_states`) plus activations held at the schedule's peak. Captures of a packed
plan are added by the caller (`pipefisher.planning.layout_predict`). Pure Python: no torch.

Activations: `pipefisher.planning.activation_memory` where it exists; until then an interim
estimate (`_interim_micro_batch_bytes`): per block and micro-batch the stored activations of
Korthikanti et al. (2022, "Reducing activation recomputation", sec. 4) at 16-bit,
s·b·h·(10 + 24/T + 5·a·s/(h·T)) bytes, doubled for fp32; selective recomputation drops the
attention-core term 5·a·s/(h·T); recomputing whole blocks keeps each block's input (s·b·h values)
plus, while one block is recomputed, its full activations; the last stage also keeps its
fp32 logits (s·b·vocab values) per micro-batch held.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from pipefisher.core.ir import OpKind, Schedule
from pipefisher.core.topology import Topology
from pipefisher.methods.registry import methods
from pipefisher.planning.layout_candidates import Layout
from pipefisher.planning.layout_model import ModelSizes
from pipefisher.planning.memory import OptimizerState, RankMemory, optimizer_state, rank_memory
from pipefisher.planning.transformer_state import TransformerSizes, transformer_stage_states

_VALUE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class MemoryUse:
    """Bytes of the rank with the most (`rank`): its training state, activations at the
    schedule's peak and captures of the packed plan; `total` their sum."""

    rank: int
    state: int
    activations: int
    captures: int = 0

    @property
    def total(self) -> int:
        return self.state + self.activations + self.captures


def _layer_model(method: str):
    """The curvature method's `from_linear` memory model, or None (first-order, or not modelled)."""
    known = methods().get(method)
    if known is None or not known.memory:
        return None
    module, _, attribute = known.memory.partition(":")
    return getattr(importlib.import_module(module), attribute)


def _optimizer(method: str, first_order: str, momentum: float) -> OptimizerState:
    """The optimizer state of `method`; a curvature method without a memory model keeps its
    first-order rule's state (its own state is not counted)."""
    if method in methods() and _layer_model(method) is None:
        return optimizer_state(first_order)
    return optimizer_state(method, momentum, first_order=first_order)


@lru_cache(maxsize=256)
def _stage_states(sizes: ModelSizes, pieces: int, tensor_parallel: int, method: str):
    model = _layer_model(method)
    transformer = TransformerSizes(sizes.blocks, sizes.hidden, sizes.ffn, sizes.vocab, max_positions=max(512, sizes.seq_len))
    return transformer_stage_states(transformer, pieces, model.from_linear if model else None, tensor_parallel=tensor_parallel,
                                    preconditions_bias=bool(model and model.PRECONDITIONS_BIAS))


_STATES: dict[tuple, tuple[RankMemory, ...]] = {}


def state_per_rank(layout: Layout, sizes: ModelSizes, first_order: str, momentum: float) -> tuple[RankMemory, ...]:
    """Every rank's training state under `layout` (its method, ZeRO-1, PowerSGD), shard 0 of
    tensor parallelism (the largest). Cached on what it depends on (not the micro-batches)."""
    powersgd = 0 if layout.zero else layout.powersgd_rank
    key = (layout.schedule, layout.stages, layout.chunks, layout.data_parallel, layout.tensor_parallel, layout.zero,
           powersgd, layout.method, sizes, first_order, momentum)
    if key not in _STATES:
        states = _stage_states(sizes, layout.pieces, layout.tensor_parallel, layout.method)
        topology = Topology(layout.build_schedule(), layout.data_parallel, layout.tensor_parallel)
        optimizer = _optimizer(layout.method, first_order, momentum)
        _STATES[key] = rank_memory(topology, states, optimizer, int(layout.zero), powersgd_rank=powersgd)
    return _STATES[key]


def _interim_micro_batch_bytes(sizes: ModelSizes, blocks: int, last: bool, micro_batch_size: int, precision: str,
                               recompute: str, tensor_parallel: int) -> int:
    """Activations one micro-batch leaves on a stage of `blocks` blocks (module docstring)."""
    s, b, h, t = sizes.seq_len, micro_batch_size, sizes.hidden, tensor_parallel
    half = s * b * h * (10 + 24 / t + (0 if recompute == "selective" else 5 * sizes.heads * s / (h * t)))
    per_block = half * _VALUE_BYTES[precision] / 2
    held = s * b * h * _VALUE_BYTES[precision] * blocks if recompute == "blocks" else per_block * blocks
    logits = s * b * sizes.vocab * 4 if last else 0
    return int(held + logits)


def _interim_peaks(schedule: Schedule, stage_bytes: Sequence[int]) -> list[int]:
    """Per rank, the most activation bytes held at once: a forward of stage s adds its bytes until
    the backward (the weight gradient where the schedule splits it) releases them."""
    release = OpKind.WEIGHT if schedule.splits_backward else OpKind.BACKWARD
    peaks = []
    for ops in schedule.ranks:
        held = peak = 0
        for op in ops:
            if op.kind is OpKind.FORWARD:
                held += stage_bytes[op.stage]
                peak = max(peak, held)
            elif op.kind is release:
                held -= stage_bytes[op.stage]
        peaks.append(peak)
    return peaks


@lru_cache(maxsize=4096)
def activation_per_rank(layout: Layout, sizes: ModelSizes, precision: str = "fp32") -> tuple[int, ...]:
    """Per rank, activation bytes at the schedule's peak (plus one block recomputed, under
    recompute blocks)."""
    schedule = layout.build_schedule()
    per_piece = sizes.blocks // layout.pieces
    last = layout.pieces - 1
    stage_bytes = [_interim_micro_batch_bytes(sizes, per_piece, piece == last, layout.micro_batch_size, precision,
                                              layout.recompute, layout.tensor_parallel) for piece in range(layout.pieces)]
    transient = 0
    if layout.recompute == "blocks":
        whole = _interim_micro_batch_bytes(sizes, 1, False, layout.micro_batch_size, precision, "none", layout.tensor_parallel)
        transient = whole - _interim_micro_batch_bytes(sizes, 1, False, layout.micro_batch_size, precision, "blocks", layout.tensor_parallel)
    return tuple(peak + transient for peak in _interim_peaks(schedule, stage_bytes))


def layout_memory(layout: Layout, sizes: ModelSizes, first_order: str, momentum: float, precision: str = "fp32",
                  captures: Sequence[int] = ()) -> MemoryUse:
    """The rank with the most bytes: state + activations (+ `captures[rank]` where given)."""
    states = state_per_rank(layout, sizes, first_order, momentum)
    activations = activation_per_rank(layout, sizes, precision)
    pipeline = len(activations)

    def use(rank: int) -> MemoryUse:
        return MemoryUse(rank, states[rank].total_bytes, activations[rank % pipeline],
                         captures[rank % pipeline] if captures else 0)

    return max((use(rank) for rank in range(len(states))), key=lambda found: found.total)
