"""A rank's peak bytes in a pipelined run: its training state (`pipefisher.planning.memory`), the
most activations it holds at once over its op order (`pipefisher.planning.activation_memory`),
the curvature captures it holds beyond those (`pipefisher.planning.capture_memory`), and its
point-to-point receive and send buffers. Pure Python: no torch.

The training state is resident all step; the activations peak once per step; captures and
buffers are added at their own peaks, so the sum bounds the rank's peak from above (they
coincide on the schedules checked, docs/memory_model.md). Gradients live in one flat buffer per
stage whose buckets are views (`pipefisher.runtime.gradient_path.buffers`), so the reduction
allocates nothing beside them; ZeRO-1's parameter buffer replaces the parameters' own storage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipefisher.core.topology import Topology
from pipefisher.planning.activation_memory import (PRECISIONS, ModelShape, activation_peaks, backward_transient_bytes,
                                                   micro_batch_bytes, weight_pending_bytes)
from pipefisher.planning.memory import ElementBytes, OptimizerState, RankMemory, StageState, rank_memory


@dataclass(frozen=True)
class RankPeak:
    """One rank's peak bytes by kind (`training`: its `RankMemory`)."""

    rank: int
    training: RankMemory
    activation_bytes: int
    capture_bytes: int = 0
    comm_buffer_bytes: int = 0

    @property
    def parameter_bytes(self) -> int:
        return self.training.parameter_bytes

    @property
    def gradient_bytes(self) -> int:
        return self.training.gradient_bytes

    @property
    def optimizer_bytes(self) -> int:
        return self.training.optimizer_bytes

    @property
    def curvature_bytes(self) -> int:
        return self.training.curvature_bytes + self.training.compression_bytes

    @property
    def total_bytes(self) -> int:
        """Training state + activation peak + held captures + point-to-point buffers."""
        return self.training.total_bytes + self.activation_bytes + self.capture_bytes + self.comm_buffer_bytes


def stage_activation_bytes(shape: ModelShape, num_stages: int, micro_batch_size: int, precision: str = "fp32",
                           recompute: str = "none", tensor_parallel: int = 1) -> tuple[list[int], list[int], list[int]]:
    """Per stage index: bytes a micro-batch keeps from F to B, from B to W (split backward), and
    its backward's transient bytes (with recompute "blocks", one block's rebuilt activations too)."""
    if num_stages < 1 or shape.blocks % num_stages:
        raise ValueError(f"num_stages: {num_stages} does not divide the model's {shape.blocks} blocks")
    blocks = shape.blocks // num_stages
    ends = [(index == 0, index == num_stages - 1) for index in range(num_stages)]
    kept = [micro_batch_bytes(shape, blocks, first, last, micro_batch_size, precision, recompute, tensor_parallel)
            for first, last in ends]
    pending = [weight_pending_bytes(shape, blocks, first, last, micro_batch_size, precision) for first, last in ends]
    transient = [backward_transient_bytes(shape, first, last, micro_batch_size, precision, recompute, tensor_parallel)
                 for first, last in ends]
    return kept, pending, transient


def comm_buffer_bytes(topology: Topology, rank: int, shape: ModelShape, micro_batch_size: int, precision: str = "fp32") -> int:
    """One micro-batch's boundary tensor (b·s·h in the compute dtype) per neighbour of each stage
    the rank holds: the activation it receives from the previous stage, the gradient from the next."""
    boundary = micro_batch_size * shape.seq_len * shape.hidden * PRECISIONS[precision]
    last = topology.schedule.num_stages - 1
    return sum(boundary * ((stage > 0) + (stage < last)) for _, stage in topology.stages_of(rank))


def peak_memory(topology: Topology, stage_states: Sequence[StageState], optimizer: OptimizerState, shape: ModelShape,
                micro_batch_size: int, precision: str = "fp32", recompute: str = "none", zero: int = 0,
                capture_bytes_per_rank: Sequence[int] | None = None, widths: ElementBytes = ElementBytes(),
                workers_per_layer: int | None = None, powersgd_rank: int = 0, tensor_parallel: int = 1) -> list[RankPeak]:
    """Every global rank's peak bytes (index = rank) for `stage_states` (one per stage index)
    placed by `topology`; `capture_bytes_per_rank`: per pipeline rank, the captures it holds at
    its peak (`pipefisher.planning.capture_memory.capture_peaks`; None: no curvature captures)."""
    schedule = topology.schedule
    training = rank_memory(topology, stage_states, optimizer, zero, widths, workers_per_layer, powersgd_rank)
    kept, pending, transient = stage_activation_bytes(shape, schedule.num_stages, micro_batch_size, precision, recompute, tensor_parallel)
    peaks = activation_peaks(schedule, kept, pending, transient)
    result = []
    for rank in range(topology.world_size):
        pipeline_rank = topology.pipeline_rank(rank)
        captures = capture_bytes_per_rank[pipeline_rank] if capture_bytes_per_rank is not None else 0
        result.append(RankPeak(rank, training[rank], peaks[pipeline_rank], captures,
                               comm_buffer_bytes(topology, rank, shape, micro_batch_size, precision)))
    return result
