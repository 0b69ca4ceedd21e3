"""A rank's peak bytes in a pipelined run: its training state (`pipefisher.planning.memory.state`), the
most activations it holds at once over its op order (`pipefisher.planning.memory.activations`),
the curvature captures it holds beyond those (`pipefisher.planning.memory.captures`), and its
point-to-point receive and send buffers (a send's tensor from the op that makes it to the rank's
wait for the send, `pipefisher.planning.comm.send_waits`). Pure Python: no torch.

The training state is resident all step; the activations peak once per step; given per rank,
captures are added at their own peak, an upper bound; given the curvature plan and its profile,
activations, captures and the refresh's statistics copies are taken at the op of the cycle where
their sum peaks (`pipefisher.planning.memory.cycle`). Buffers are added at their peak. Gradients live in one flat buffer per
stage whose buckets are views (`pipefisher.runtime.gradient_path.buffers`), so the reduction
allocates nothing beside them; ZeRO-1's parameter buffer replaces the parameters' own storage.
ZeRO-2/3 stages have no such buffer: their parameters and gradients are counted at the step's peak
(FSDP2's gathered parameters and unreduced gradient, `pipefisher.planning.memory.sharded`).
Under bf16/fp16 the low-precision copies of the weights count with the activations: without FSDP
(ZeRO-0/1) one copy per stage the rank holds, kept all step by the runtime's step cache
(`rank_cast_bytes`); under ZeRO-2/3 one per micro-batch in flight, saved by its graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipefisher.core.topology import Topology
from pipefisher.core.stage_split import stage_block_ranges
from pipefisher.planning.memory.activations import (
    PRECISIONS,
    ModelShape,
    _residual_bytes,
    activation_peaks,
    micro_batch_bytes,
    step_cast_bytes,
    weight_pending_bytes,
)
from pipefisher.core.profile import Profile
from pipefisher.planning.memory.backward import backward_transient_bytes
from pipefisher.planning.memory.cycle import CyclePeak, cycle_peaks
from pipefisher.planning.memory.helped import help_bytes_per_rank
from pipefisher.planning.memory.layer_model import refresh_copies, refresh_work, stage_layers
from pipefisher.planning.memory.state import ElementBytes, OptimizerState, RankMemory, StageState, rank_memory
from pipefisher.planning.plan import Plan


@dataclass(frozen=True)
class RankPeak:
    """One rank's peak bytes by kind (`training`: its `RankMemory`; `activation_bytes` with the
    step cache's low-precision weight copies; `help_bytes`: what its help ops hold all cycle,
    `pipefisher.planning.memory.helped`)."""

    rank: int
    training: RankMemory
    activation_bytes: int
    capture_bytes: int = 0
    comm_buffer_bytes: int = 0
    refresh_bytes: int = 0
    help_bytes: int = 0

    @property
    def parameter_bytes(self) -> int:
        """At the step's peak (ZeRO-2/3: shards plus gathered parameters)."""
        return self.training.peak_parameter_bytes

    @property
    def gradient_bytes(self) -> int:
        """At the step's peak (ZeRO-2/3: the whole unreduced gradient)."""
        return self.training.peak_gradient_bytes

    @property
    def optimizer_bytes(self) -> int:
        return self.training.optimizer_bytes

    @property
    def curvature_bytes(self) -> int:
        return self.training.curvature_bytes + self.training.compression_bytes

    @property
    def total_bytes(self) -> int:
        """Training state, activations, held captures, refresh copies, point-to-point and help buffers."""
        return (
            self.training.total_bytes
            + self.activation_bytes
            + self.capture_bytes
            + self.refresh_bytes
            + self.comm_buffer_bytes
            + self.help_bytes
        )


def stage_activation_bytes(
    shape: ModelShape,
    num_stages: int,
    micro_batch_size: int,
    precision: str = "fp32",
    recompute: str = "none",
    tensor_parallel: int = 1,
    step_cache: bool = True,
) -> tuple[list[int], list[int], list[int]]:
    """Per stage index: bytes a micro-batch keeps from F to B, from B to W (split backward), and
    its backward's transient bytes (`pipefisher.planning.memory.backward`: gradients in flight, the
    weight gradients before their accumulation, one block's rebuilt activations under recompute
    "blocks").
    `step_cache` (the runtime's without FSDP, ZeRO-0/1): the low-precision weight copies are held
    once per step (`rank_cast_bytes`), not per micro-batch; False (ZeRO-2/3): each micro-batch's
    graph saves its own."""
    blocks = _stage_blocks(shape, num_stages)
    ends = [(index == 0, index == num_stages - 1, blocks[index]) for index in range(num_stages)]
    casts = not step_cache
    kept = [
        micro_batch_bytes(shape, held, first, last, micro_batch_size, precision, recompute, tensor_parallel, casts)
        for first, last, held in ends
    ]
    pending = [
        weight_pending_bytes(shape, held, first, last, micro_batch_size, precision, casts) for first, last, held in ends
    ]
    transient = [
        backward_transient_bytes(
            shape, first, last, micro_batch_size, precision, recompute, tensor_parallel, casts, held
        )
        for first, last, held in ends
    ]
    return kept, pending, transient


def _stage_blocks(shape: ModelShape, num_stages: int) -> list[int]:
    """Blocks of each stage: `shape.stage_blocks`, or the model's blocks dealt evenly."""
    return [len(held) for held in stage_block_ranges(shape.blocks, num_stages, shape.stage_blocks)]


def rank_cast_bytes(
    topology: Topology,
    rank: int,
    shape: ModelShape,
    precision: str = "fp32",
    tensor_parallel: int = 1,
    step_cache: bool = True,
) -> int:
    """The step cache's low-precision weight copies of every stage the rank holds (one copy per
    stage and step, `step_cast_bytes`), held at its activation peak; 0 without the step cache
    (ZeRO-2/3: counted per micro-batch by `stage_activation_bytes`) or under fp32."""
    if not step_cache:
        return 0
    num_stages = topology.schedule.num_stages
    blocks = _stage_blocks(shape, num_stages)
    return sum(
        step_cast_bytes(shape, blocks[stage], stage == 0, stage == num_stages - 1, precision, tensor_parallel)
        for _, stage in topology.stages_of(rank)
    )


def comm_buffer_bytes(
    topology: Topology, rank: int, shape: ModelShape, micro_batch_size: int, precision: str = "fp32"
) -> int:
    """One micro-batch's boundary tensor (b·s·h in the compute dtype) per neighbour of each stage
    the rank holds: the activation it receives from the previous stage, the gradient from the next."""
    boundary = micro_batch_size * shape.seq_len * shape.hidden * PRECISIONS[precision]
    last = topology.schedule.num_stages - 1
    return sum(boundary * ((stage > 0) + (stage < last)) for _, stage in topology.stages_of(rank))


def stage_sent_bytes(
    shape: ModelShape, num_stages: int, micro_batch_size: int, precision: str = "fp32"
) -> list[tuple[int, int]]:
    """Per stage index, (forward, backward): the bytes of the boundary tensor its op sends that the
    send holds beyond what `stage_activation_bytes` counts, from the op until the rank waits for
    the send (`pipefisher.planning.comm.send_waits`, soon after; `activation_held` counts them
    there). A forward sends its output (b·s·h in the compute dtype): the stage's own output, held
    anyway until its backward (0), unless the first stage's fp32 output under bf16/fp16 is sent as
    a copy. The output is not held past the backward by its send: the backward's input comes from
    the peer the output went to, sent after it posted the output's receive, so the send is waited
    for before the backward runs (rule (a)). A backward sends its input gradient (b·s·h·c, every
    stage but the first)."""
    c = PRECISIONS[precision]
    boundary = micro_batch_size * shape.seq_len * shape.hidden
    result = []
    for index in range(num_stages):
        first, last = index == 0, index == num_stages - 1
        copied = not last and _residual_bytes(shape, first, c) != c  # the sent copy, alive from the forward
        result.append((boundary * c if copied else 0, 0 if first else boundary * c))
    return result


def peak_memory(
    topology: Topology,
    stage_states: Sequence[StageState],
    optimizer: OptimizerState,
    shape: ModelShape,
    micro_batch_size: int,
    precision: str = "fp32",
    recompute: str = "none",
    zero: int = 0,
    capture_bytes_per_rank: Sequence[int] | None = None,
    widths: ElementBytes = ElementBytes(),
    workers_per_layer: int | None = None,
    powersgd_rank: int = 0,
    tensor_parallel: int = 1,
    plan: Plan | None = None,
    profile: Profile | None = None,
) -> list[RankPeak]:
    """Every global rank's peak bytes (index = rank) for `stage_states` (one per stage index)
    placed by `topology`; `capture_bytes_per_rank`: per pipeline rank, the captures it holds at
    its peak (`pipefisher.planning.memory.captures.capture_peaks`; None: no curvature captures);
    `plan` and `profile` (both or neither): the curvature plan the run executes and the profile
    of its capture sizes, whose cycle gives activations, captures and refresh copies at their
    joint peak instead (`capture_bytes_per_rank` is then ignored) and its help ops' buffers."""
    schedule = topology.schedule
    training = rank_memory(topology, stage_states, optimizer, zero, widths, workers_per_layer, powersgd_rank)
    step_cache = zero < 2  # the runtime's: ZeRO-2/3 (FSDP2) cast per forward
    kept, pending, transient = stage_activation_bytes(
        shape, schedule.num_stages, micro_batch_size, precision, recompute, tensor_parallel, step_cache
    )
    sent = stage_sent_bytes(shape, schedule.num_stages, micro_batch_size, precision)
    helped = [0] * schedule.num_ranks
    if plan is not None and profile is not None:
        layers = stage_layers([stage.curvature_layers for stage in stage_states])
        refresh, work = refresh_copies(layers, widths.factor), refresh_work(layers, widths.factor)
        joint = cycle_peaks(plan, profile, kept, pending, transient, refresh, sent, work)
        helped = help_bytes_per_rank(plan, layers, widths.factor)
    else:
        peaks = activation_peaks(schedule, kept, pending, transient, sent)
        captures = capture_bytes_per_rank if capture_bytes_per_rank is not None else [0] * schedule.num_ranks
        joint = [CyclePeak(rank, peaks[rank], captures[rank], 0) for rank in range(schedule.num_ranks)]
    result = []
    for rank in range(topology.world_size):
        held = joint[topology.pipeline_rank(rank)]
        result.append(
            RankPeak(
                rank,
                training[rank],
                held.activation_bytes + rank_cast_bytes(topology, rank, shape, precision, tensor_parallel, step_cache),
                held.capture_bytes,
                comm_buffer_bytes(topology, rank, shape, micro_batch_size, precision),
                held.refresh_bytes,
                helped[topology.pipeline_rank(rank)],
            )
        )
    return result
