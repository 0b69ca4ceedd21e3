"""Bytes per rank of a layout: training state (parameters, gradients, optimizer and curvature
state, PowerSGD's; `pipefisher.planning.memory.rank_memory` over the model's
`transformer_stage_states`) plus activations held at the schedule's peak. Captures of a packed
plan are added by the caller (`pipefisher.planning.layout_predict`). Pure Python: no torch.

Activations: `pipefisher.planning.activation_memory` (what autograd saves per micro-batch, held
from each forward to its backward, or its weight gradient under a split backward, at the
schedule's peak) and the point-to-point buffers (`pipefisher.planning.peak_memory`). K-FAC's
captured inputs are the tensors autograd saves too while their micro-batch is in flight: both
counts keep them, an overestimate of at most one capture per micro-batch in flight.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from pipefisher.core.topology import Topology
from pipefisher.methods.registry import methods
from pipefisher.planning.layout_candidates import Layout
from pipefisher.planning.activation_memory import activation_peaks
from pipefisher.planning.layout_model import ModelSizes
from pipefisher.planning.memory import OptimizerState, RankMemory, optimizer_state, rank_memory
from pipefisher.planning.peak_memory import comm_buffer_bytes, stage_activation_bytes
from pipefisher.planning.transformer_state import TransformerSizes, transformer_stage_states



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


def layer_memory_model(method: str):
    """The curvature method's `from_linear` memory model, or None (first-order, or not modelled)."""
    known = methods().get(method)
    if known is None or not known.memory:
        return None
    module, _, attribute = known.memory.partition(":")
    return getattr(importlib.import_module(module), attribute)


def _optimizer(method: str, first_order: str, momentum: float) -> OptimizerState:
    """The optimizer state of `method`; a curvature method without a memory model keeps its
    first-order rule's state (its own state is not counted)."""
    if method in methods() and layer_memory_model(method) is None:
        return optimizer_state(first_order)
    return optimizer_state(method, momentum, first_order=first_order)


@lru_cache(maxsize=256)
def _stage_states(sizes: ModelSizes, pieces: int, tensor_parallel: int, method: str):
    model = layer_memory_model(method)
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


@lru_cache(maxsize=4096)
def activation_per_rank(layout: Layout, sizes: ModelSizes, precision: str = "fp32") -> tuple[int, ...]:
    """Per rank of one pipeline, activation bytes at the schedule's peak
    (`pipefisher.planning.activation_memory.activation_peaks`, with each backward's transient
    bytes) plus its point-to-point buffers (`comm_buffer_bytes`)."""
    schedule = layout.build_schedule()
    shape = sizes.shape
    kept, pending, transient = stage_activation_bytes(shape, layout.pieces, layout.micro_batch_size, precision, layout.recompute,
                                                      layout.tensor_parallel)
    peaks = activation_peaks(schedule, kept, pending, transient)
    topology = Topology(schedule)
    return tuple(peak + comm_buffer_bytes(topology, rank, shape, layout.micro_batch_size, precision) for rank, peak in enumerate(peaks))


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
