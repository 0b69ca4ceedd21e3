"""The prediction of one layout: its step time per optimizer step, throughput, memory per rank and
why. Pure Python: no torch.

Step time: the simulator's first-order step (`simulate`) of the layout's schedule with the time
source's profile; for a curvature method the packer's chosen plan (`pack` with the method
section's options, which choose at a percentile of the profile's samples): the chosen plan's
cycle simulated at the profile's own (median) times over its refresh interval k, i.e. the mean
step with the refresh work in the bubbles and what does not fit. Data-parallel traffic: where the profile has
no measured `grad_reduce`, each stage's reduction is the bytes a rank sends for it
(`rank_memory`'s ring model: all-reduce, ZeRO-1's reduce + broadcast, ZeRO-2's reduce-scatter +
the step's one all-gather of its parameters, PowerSGD's factors) at `dp_bandwidth_gbps`; under
ZeRO-3 the reduction is the reduce-scatter, and FSDP2's all-gather of the stage's parameters
(ring model, same bandwidth) is added to every forward and backward of the stage (each op
gathers every block it runs, blocking: no overlap with compute is assumed). With stage replicas,
a curvature layer's factor syncs, where the layer is one of a Transformer block's Linears of
known shape, are the all-reduce of its n x n factors at that bandwidth. Recomputation: `pipefisher.planning.recompute` (backward += the recomputed share of the forward).

With a `hardware` description (`pipefisher.planning.planner.hardware`) every collective is costed
on the link it crosses (`pipefisher.planning.planner.links`, which also says how ranks are placed):
the data-parallel traffic above on the slowest link a stage's replicas span (its bandwidth
`dp_bandwidth_gbps` instead where `dp_bandwidth_set`), plus the link's latency per ring step
(all-reduce 2(n-1), reduce-scatter and all-gather n-1, n the replicas); pipeline hops without a
measured p2p time cost one micro-batch's activation (micro-batch x seq_len x hidden in the run's
precision) on the link between the two stages, plus one latency. Without it nothing changes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipefisher.config import FIRST_ORDER
from pipefisher.core.ir import Schedule
from pipefisher.core.profile import LayerProfile, Profile, Samples, StageProfile
from pipefisher.methods.settings import RefreshConfig
from pipefisher.planning.memory.activations import PRECISIONS
from pipefisher.planning.comm.volume import ring_bytes
from pipefisher.planning.planner.candidates import Layout, stage_replicas
from pipefisher.planning.planner.hardware import Hardware, Link
from pipefisher.planning.planner.links import data_parallel_link, hop_links
from pipefisher.planning.planner.layout_memory import (
    MemoryUse,
    block_linear_shapes,
    layout_memory,
    packed_memory,
    stage_parameters,
    state_per_rank,
)
from pipefisher.planning.planner.flop_times import FlopTimes
from pipefisher.planning.planner.model_sizes import ModelSizes
from pipefisher.planning.planner.sources import MS_PER_UNIT, MeasuredTimes, ReferenceTimes, measured_bandwidth_gbps
from pipefisher.planning.recompute import recompute_forward_share, with_recompute
from pipefisher.planning.packing.pack import PackOptions, PackResult
from pipefisher.planning.planner.pack_cache import PACKINGS
from pipefisher.planning.plan import cycle_time, simulate_plan
from pipefisher.planning.simulate import simulate

TimeSource = ReferenceTimes | MeasuredTimes | FlopTimes
#: data-parallel all-reduce bandwidth assumed (GB/s, nccl-tests' busbw), a round figure for
#: 100 Gb/s InfiniBand between nodes; `--dp-bandwidth-gbps` sets it
DEFAULT_DP_BANDWIDTH_GBPS = 10.0
FACTOR_BYTES = 4
#: bytes of an fp32 parameter element (what FSDP2 gathers)
PARAMETER_BYTES = 4


@dataclass(frozen=True)
class PlanContext:
    """What every prediction of one search shares: the model's sizes, the time source, the rule
    first-order parameters take (`first_order`), the curvature method's run-file section (None:
    first-order only), SGD momentum (optimizer state), precision (activations) and the
    data-parallel bandwidth (GB/s); `hardware`: where collectives are costed on the links they
    cross (None: every one at `dp_bandwidth_gbps`, no latency), `dp_bandwidth_set`: the
    data-parallel bandwidth was given and overrides the hardware's links for that traffic."""

    sizes: ModelSizes
    source: TimeSource
    first_order: str
    section: RefreshConfig | None = None
    momentum: float = 0.0
    precision: str = "fp32"
    dp_bandwidth_gbps: float = DEFAULT_DP_BANDWIDTH_GBPS
    hardware: Hardware | None = None
    dp_bandwidth_set: bool = False

    def data_parallel_link(self, layout: Layout) -> Link:
        """The link of `layout`'s data-parallel traffic (`links.data_parallel_link`)."""
        return data_parallel_link(layout, self.hardware, self.dp_bandwidth_gbps, self.dp_bandwidth_set)


@dataclass(frozen=True)
class Prediction:
    """A layout (its `refresh_steps` the packer's k) and what it is predicted to do: `step_ms`
    per optimizer step (ms), `first_order_ms` the same pipeline's first-order step, `bubble_share`
    idle share of device time in the first-order step (0..1), `overhead_share` the method's
    added time over the first-order step (0..1+: its exposed share, `step_ms / first_order_ms - 1`), `reduce_ms` the slowest stage's data-parallel
    reduction (ms), `memory` its rank with the most bytes; `reason` the packer's choice of k."""

    layout: Layout
    step_ms: float
    first_order_ms: float
    bubble_share: float
    overhead_share: float
    reduce_ms: float
    memory: MemoryUse
    tokens_per_sample: int
    reason: str = ""

    @property
    def samples_per_s(self) -> float:
        return self.layout.global_batch / (self.step_ms / 1e3) if self.step_ms else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.samples_per_s * self.tokens_per_sample


def source_bandwidth_gbps(source: TimeSource, sizes: ModelSizes, precision: str) -> float:
    """The data-parallel bandwidth a search assumes: what the first measured profile's stage-boundary
    transfers show (`measured_bandwidth_gbps`; activations in the run's compute dtype), else
    `DEFAULT_DP_BANDWIDTH_GBPS`."""
    if isinstance(source, MeasuredTimes):
        for _, profile in source.profiles:
            found = measured_bandwidth_gbps(profile, sizes, PRECISIONS[precision])
            if found:
                return found
    return DEFAULT_DP_BANDWIDTH_GBPS


def is_curvature(method: str) -> bool:
    return method not in FIRST_ORDER


def _recomputed(profile: Profile, mode: str, sizes: ModelSizes, stage_blocks: tuple[int, ...] = ()) -> Profile:
    """The profile with recomputation's cost (`pipefisher.planning.recompute`): each stage's
    backward grows by the share of its forward that `mode` recomputes, by flops, its blocks
    (`stage_blocks`, else dealt out evenly) and the last stage's vocabulary projection counted
    outside them."""
    if mode == "none":
        return profile
    stages = profile.num_stages
    bounds = [round(stage * sizes.blocks / stages) for stage in range(stages + 1)]
    counts = stage_blocks or tuple(bounds[i + 1] - bounds[i] for i in range(stages))
    head = 2.0 * sizes.shape.head_rows * sizes.hidden * sizes.vocab
    shares = [
        recompute_forward_share(
            mode, sizes.hidden, sizes.ffn, sizes.seq_len, counts[i], head if i == stages - 1 else 0.0
        )
        for i in range(stages)
    ]
    return with_recompute(profile, mode, shares)


def _factor_sizes(sizes: ModelSizes, tensor_parallel: int) -> dict[str, tuple[int, int]]:
    """Layer-name suffix -> (A, B) factor sizes of a block's Linears (reference and BERT module names)."""
    return {suffix: (din + 1, dout) for suffix, (din, dout) in block_linear_shapes(sizes, tensor_parallel).items()}


def _with_reductions(profile: Profile, layout: Layout, context: PlanContext) -> Profile:
    """`profile` with each stage's modelled gradient reduction where it has no measured one, and
    under ZeRO-3 FSDP2's all-gathers in its forwards and backwards (`_gathering`)."""
    per_ms = MS_PER_UNIT[profile.time_unit]
    states = state_per_rank(layout, context.sizes, context.first_order, context.momentum)
    traffic = {part.stage: part.grad_comm_bytes for rank in states for part in rank.stages}
    link = context.data_parallel_link(layout)
    scale = 1e3 / (link.bandwidth_gbps * 1e9) / per_ms
    ring_pass = link.latency_us * 1e-3 / per_ms * (stage_replicas(layout) - 1)  # latency of one pass round the ring
    reduce_passes = 2  # an all-reduce (or reduce + broadcast) is two passes
    gathers = [0.0] * profile.num_stages
    if layout.zero == 3 and layout.data_parallel > 1:
        parameters = stage_parameters(layout, context.sizes)
        gathers = [
            ring_bytes("broadcast", numel * PARAMETER_BYTES, layout.data_parallel) * scale + ring_pass
            for numel in parameters
        ]
        traffic = {
            index: ring_bytes("reduce", numel * PARAMETER_BYTES, layout.data_parallel)
            for index, numel in enumerate(parameters)
        }
        reduce_passes = 1
    return replace(
        profile,
        stages=tuple(
            _gathering(
                replace(
                    stage,
                    grad_reduce=stage.grad_reduce
                    or traffic.get(index, 0) * scale + (reduce_passes * ring_pass if traffic.get(index) else 0.0),
                ),
                gather,
            )
            for index, (stage, gather) in enumerate(zip(profile.stages, gathers))
        ),
    )


def _gathering(stage: StageProfile, gather: float) -> StageProfile:
    """`stage` with `gather` (profile time units) added to its forward and backward and to each of
    their samples."""
    if not gather:
        return stage
    samples = dict(stage.samples)
    for name in ("forward", "backward"):
        if name in samples:
            samples[name] = tuple(value + gather for value in samples[name])
    return replace(
        stage,
        forward=stage.forward + gather,
        backward=stage.backward + gather,
        weight=stage.weight_gradient,
        samples=Samples(samples),
    )


def _with_syncs(profile: Profile, layout: Layout, context: PlanContext) -> Profile:
    """`profile` with modelled factor syncs of the layers of known shape that have no measured ones."""
    replicas = stage_replicas(layout)
    if replicas < 2:
        return profile
    link = context.data_parallel_link(layout)
    scale = 1e3 / (link.bandwidth_gbps * 1e9) / MS_PER_UNIT[profile.time_unit]
    latency = 2 * (replicas - 1) * link.latency_us * 1e-3 / MS_PER_UNIT[profile.time_unit]
    factors = _factor_sizes(context.sizes, layout.tensor_parallel)

    def sync(layer: LayerProfile) -> LayerProfile:
        found = next((shape for suffix, shape in factors.items() if layer.name.endswith(suffix)), None)
        if found is None or layer.sync:
            return layer
        return replace(
            layer,
            sync=tuple(ring_bytes("all_reduce", n * n * FACTOR_BYTES, replicas) * scale + latency for n in found),
        )

    return replace(
        profile, stages=tuple(replace(stage, layers=tuple(map(sync, stage.layers))) for stage in profile.stages)
    )


def _with_hops(profile: Profile, layout: Layout, context: PlanContext) -> Profile:
    """`profile` with each stage's pipeline hop costed on its link (module docstring) where the
    context has hardware and the stage has no measured p2p time."""
    if context.hardware is None:
        return profile
    links = hop_links(layout, context.hardware)
    sizes = context.sizes
    activation = layout.micro_batch_size * sizes.seq_len * sizes.hidden * PRECISIONS[context.precision]
    per_ms = MS_PER_UNIT[profile.time_unit]

    def hop(index: int, stage: StageProfile) -> StageProfile:
        link = links[index] if index < len(links) else None
        if link is None or stage.p2p:
            return stage
        return replace(stage, p2p=link.ring_seconds(activation, 1) * 1e3 / per_ms)

    return replace(profile, stages=tuple(hop(index, stage) for index, stage in enumerate(profile.stages)))


def _owned_step_end(profile: Profile, layout: Layout) -> Profile:
    """Under ZeRO-1 each of a stage's R replicas preconditions in its optimizer step only the
    matrices it owns (Shampoo's and SOAP's `precondition_all(updates)`, owners balanced by size):
    the flop model's method step end, one replica's whole stage, becomes 1/R of it."""
    replicas = stage_replicas(layout)
    if layout.zero != 1 or replicas < 2:
        return profile
    stages = tuple(
        replace(
            s,
            step_end=s.step_end - s.method_step_end * (1 - 1 / replicas),
            method_step_end=s.method_step_end / replicas,
        )
        for s in profile.stages
    )
    return replace(profile, stages=stages)


def layout_profile(layout: Layout, context: PlanContext, syncs: bool = True) -> Profile:
    """The profile a layout's prediction simulates: the source's at its stage split, backward split,
    micro-batch size and degree, with recomputation, gradient reductions and (`syncs`) factor syncs;
    the method's step end shared by ZeRO-1's owners where the source's is one replica's whole stage
    (`_owned_step_end`)."""
    split = layout.build_schedule().splits_backward
    profile = context.source.profile(
        layout.pieces, layout.micro_batch_size, layout.tensor_parallel, split, layout.stage_blocks
    )
    if context.source.step_end_of_whole_stage:
        profile = _owned_step_end(profile, layout)
    profile = _with_reductions(
        _recomputed(profile, layout.recompute, context.sizes, layout.stage_blocks), layout, context
    )
    profile = _with_hops(profile, layout, context)
    return _with_syncs(profile, layout, context) if syncs else profile


_FIRST_ORDER: dict[tuple, tuple[float, float, float]] = {}


def first_order_time(layout: Layout, context: PlanContext) -> tuple[float, float, float]:
    """(step ms, bubble share, slowest reduction ms) of the layout's first-order step, its end of
    step without a method's work the profile measured there (`StageProfile.method_step_end`); cached
    on the pipeline, its reductions and op times (layouts that differ in method or ZeRO-1 alone share it)."""
    profile = layout_profile(layout, context, syncs=False)
    key = (
        context,
        layout.schedule,
        layout.stages,
        layout.micro_batches,
        layout.chunks,
        layout.micro_batch_size,
        layout.tensor_parallel,
        layout.recompute,
        tuple(
            (stage.forward, stage.backward, stage.grad_reduce, stage.p2p, stage.step_end, stage.method_step_end)
            for stage in profile.stages
        ),
    )
    if key not in _FIRST_ORDER:
        timeline = simulate(layout.build_schedule(), profile, first_order=True)
        per_ms = MS_PER_UNIT[profile.time_unit]
        _FIRST_ORDER[key] = (
            timeline.step_time * per_ms,
            timeline.bubble_fraction,
            max(stage.grad_reduce for stage in profile.stages) * per_ms,
        )
    return _FIRST_ORDER[key]


def pack_options(
    layout: Layout, context: PlanContext, capture_budget: int | None = None, precondition: bool = True
) -> PackOptions:
    """The packer's options for the layout: its method section's, its data-parallel copies, its
    refresh interval when pinned (layout.refresh_steps > 0), captures capped at `capture_budget`
    bytes per device (at least 1 MiB) where given and the section sets no cap; `precondition`
    False: K-FAC's gradient workers precondition in the step end (the run's `workers_per_layer`)."""
    if context.section is None:
        raise ValueError(f"layout method {layout.method!r}: the context has no curvature section to pack with")
    options = PackOptions.from_section(
        context.section,
        data_parallel=layout.data_parallel,
        refresh_steps=layout.refresh_steps or None,
        precondition=precondition,
    )
    if capture_budget is None or options.max_capture_mb is not None:
        return options
    return replace(options, max_capture_mb=max(1.0, capture_budget / 2**20))


def plan_layout(
    layout: Layout,
    context: PlanContext,
    capture_budget: int | None = None,
    precondition: bool = True,
    schedule: Schedule | None = None,
) -> tuple[PackResult, Profile]:
    """The one packing of a layout that `plan`, `pack` and `run` share: the packer's result on the
    layout's profile (`layout_profile`: the source's times with recomputation, modelled gradient
    reductions and factor syncs where none are measured) with the section's options
    (`pack_options`), and that profile (for simulating the plan at nominal times). `schedule`:
    the layout's, where the caller has built it (it must be `layout.build_schedule()`'s). Cached in
    `PACKINGS`."""
    profile = layout_profile(layout, context)
    options = pack_options(layout, context, capture_budget, precondition)
    return PACKINGS.packed(schedule or layout.build_schedule(), profile, options), profile


def predict(layout: Layout, context: PlanContext, memory_budget: int | None = None) -> Prediction:
    """The prediction of `layout` (module docstring). A curvature method is packed (`plan_layout`)
    with its captures capped at what `memory_budget` (bytes per device) leaves beside state and
    activations (the packer keeps its uncapped plan where that fits: one packing either way); no cap
    where state and activations alone exceed the budget. The prediction's layout holds
    the chosen k (or the layout's pinned `refresh_steps`)."""
    first_ms, bubble, reduce_ms = first_order_time(layout, context)
    tokens = context.sizes.seq_len
    held = layout_memory(layout, context.sizes, context.first_order, context.momentum, context.precision)
    if not is_curvature(layout.method):
        return Prediction(layout, first_ms, first_ms, bubble, 0.0, reduce_ms, held, tokens)
    if context.section is None:
        raise ValueError(f"layout method {layout.method!r}: the context has no curvature section to pack with")
    headroom = memory_budget - held.total if memory_budget is not None and memory_budget >= held.total else None
    result, profile = plan_layout(layout, context, headroom)
    step_ms = (
        cycle_time(simulate_plan(result.plan, profile, graph=result.graph))
        / result.refresh_steps
        * MS_PER_UNIT[profile.time_unit]
    )
    packed = replace(layout, refresh_steps=result.refresh_steps)
    memory = packed_memory(
        packed, context.sizes, context.first_order, context.momentum, context.precision, result.plan, profile
    )
    return Prediction(
        packed,
        step_ms,
        first_ms,
        bubble,
        step_ms / first_ms - 1 if first_ms else 0.0,
        reduce_ms,
        memory,
        tokens,
        result.reason,
    )
