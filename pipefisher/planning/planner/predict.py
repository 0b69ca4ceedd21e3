"""The prediction of one layout: its step time per optimizer step, throughput, memory per rank and
why. Pure Python: no torch.

Step time: the simulator's first-order step (`simulate`) of the layout's schedule with the time
source's profile; for a curvature method the packer's chosen plan (`pack` with the method
section's options, which choose at a percentile of the profile's samples): the chosen plan's
cycle simulated at the profile's own (median) times over its refresh interval k, i.e. the mean
step with the refresh work in the bubbles and what does not fit. The profile a layout is
simulated with: `pipefisher.planning.planner.layout_profile`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipefisher.core.ir import Schedule
from pipefisher.core.profile import Profile
from pipefisher.planning.packing.pack import PackOptions, PackResult
from pipefisher.planning.packing.step_end import has_p_ops
from pipefisher.planning.plan import cycle_time, simulate_plan
from pipefisher.planning.planner.candidates import Layout
from pipefisher.planning.planner.context import (
    DEFAULT_DP_BANDWIDTH_GBPS,
    PlanContext,
    TimeSource,
    is_curvature,
    source_bandwidth_gbps,
)
from pipefisher.planning.planner.layout_memory import MemoryUse, layout_memory, packed_memory, refresh_floor
from pipefisher.planning.planner.layout_profile import layout_profile
from pipefisher.planning.planner.pack_cache import PACKINGS
from pipefisher.planning.planner.sources import MS_PER_UNIT
from pipefisher.planning.simulate import simulate

__all__ = [
    "DEFAULT_DP_BANDWIDTH_GBPS",
    "PlanContext",
    "Prediction",
    "TimeSource",
    "first_order_time",
    "is_curvature",
    "layout_profile",
    "method_memory",
    "pack_options",
    "plan_layout",
    "predict",
    "source_bandwidth_gbps",
    "step_end_time",
]


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


_SIMULATED: dict[tuple, tuple[float, float, float]] = {}


def _simulated(layout: Layout, context: PlanContext, first_order: bool) -> tuple[float, float, float]:
    """(step ms, bubble share, slowest reduction ms) of the layout's step without per-step or
    refresh ops, its end of step with the method's work in it or (`first_order`) without; cached on
    the pipeline, its reductions and op times (layouts that differ in method or ZeRO-1 alone share
    it where their times agree)."""
    profile = layout_profile(layout, context, syncs=False)
    plain = first_order and any(stage.method_step_end for stage in profile.stages)
    key = (
        context,
        plain,
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
    if key not in _SIMULATED:
        timeline = simulate(layout.build_schedule(), profile, first_order=plain)
        per_ms = MS_PER_UNIT[profile.time_unit]
        _SIMULATED[key] = (
            timeline.step_time * per_ms,
            timeline.bubble_fraction,
            max(stage.grad_reduce for stage in profile.stages) * per_ms,
        )
    return _SIMULATED[key]


def first_order_time(layout: Layout, context: PlanContext) -> tuple[float, float, float]:
    """(step ms, bubble share, slowest reduction ms) of the layout's first-order step, its end of
    step without a method's work the profile measured there (`StageProfile.method_step_end`)."""
    return _simulated(layout, context, first_order=True)


def step_end_time(layout: Layout, context: PlanContext) -> float:
    """ms of the layout's step with its method's end-of-step work (`StageProfile.method_step_end`:
    as the gradient path shares it, ZeRO-1's owners each a part) and none of its refresh or per-step
    ops; for a first-order method, its first-order step."""
    return _simulated(layout, context, first_order=False)[0]


def method_memory(layout: Layout, context: PlanContext) -> MemoryUse:
    """The least the layout needs per rank with its method before any packing: state and
    activations at the schedule's peak (`layout_memory`) or, where larger, the refresh copies that
    every plan of a curvature method holds at its cycle's end beside the state (`refresh_floor`:
    K-FAC's factors and pending inverses, SOAP's pending bases). A packed plan needs at least this
    (`packed_memory`)."""
    workers, settings = context.workers_per_layer(layout), context.layer_settings(layout)
    held = layout_memory(
        layout, context.sizes, context.first_order, context.momentum, context.precision, workers, settings
    )
    if not is_curvature(layout.method):
        return held
    profile = layout_profile(layout, context, syncs=False)
    floor = refresh_floor(
        layout, context.sizes, context.first_order, context.momentum, context.precision, profile, workers, settings
    )
    return max(held, floor, key=lambda use: use.total)


def pack_options(layout: Layout, context: PlanContext, capture_budget: int | None = None) -> PackOptions:
    """The packer's options for the layout: its method section's, its data-parallel copies, its
    refresh interval when pinned (layout.refresh_steps > 0), captures capped at `capture_budget`
    bytes per device (at least 1 MiB) where given and the section sets no cap; no P ops where the
    layout has none (`PlanContext.precondition_op`: gradient workers precondition in the step end,
    Shampoo without helpers in its optimizer step, as the run's `precondition_op`)."""
    if context.section is None:
        raise ValueError(f"layout method {layout.method!r}: the context has no curvature section to pack with")
    options = PackOptions.from_section(
        context.section,
        data_parallel=layout.data_parallel,
        refresh_steps=layout.refresh_steps or None,
        precondition=context.precondition_op(layout),
    )
    if capture_budget is None or options.max_capture_mb is not None:
        return options
    return replace(options, max_capture_mb=max(1.0, capture_budget / 2**20))


def plan_layout(
    layout: Layout,
    context: PlanContext,
    capture_budget: int | None = None,
    schedule: Schedule | None = None,
) -> tuple[PackResult, Profile]:
    """The one packing of a layout that `plan`, `pack` and `run` share: the packer's result on the
    layout's profile (`layout_profile`: the source's times with recomputation, modelled gradient
    reductions and factor syncs where none are measured) with the section's options
    (`pack_options`), and the profile its plan's times are of (`PackResult.profile`: that one,
    with the P ops' work in the step end where the packer left them out). `schedule`:
    the layout's, where the caller has built it (it must be `layout.build_schedule()`'s). Cached in
    `PACKINGS`."""
    profile = layout_profile(layout, context)
    options = pack_options(layout, context, capture_budget)
    plain = context.without_p_ops(layout)
    without = layout_profile(layout, plain) if plain is not None else None
    result = PACKINGS.packed(schedule or layout.build_schedule(), profile, options, without)
    return result, result.profile


def predict(layout: Layout, context: PlanContext, memory_budget: int | None = None) -> Prediction:
    """The prediction of `layout` (module docstring). A curvature method is packed (`plan_layout`)
    with its captures capped at what `memory_budget` (bytes per device) leaves beside state and
    activations (the packer keeps its uncapped plan where that fits: one packing either way); no cap
    where state and activations alone exceed the budget. The prediction's layout holds
    the chosen k (or the layout's pinned `refresh_steps`)."""
    first_ms, bubble, reduce_ms = first_order_time(layout, context)
    tokens = context.sizes.seq_len
    workers, settings = context.workers_per_layer(layout), context.layer_settings(layout)
    held = layout_memory(
        layout, context.sizes, context.first_order, context.momentum, context.precision, workers, settings
    )
    if not is_curvature(layout.method):
        return Prediction(layout, first_ms, first_ms, bubble, 0.0, reduce_ms, held, tokens)
    if context.section is None:
        raise ValueError(f"layout method {layout.method!r}: the context has no curvature section to pack with")
    headroom = memory_budget - held.total if memory_budget is not None and memory_budget >= held.total else None
    result, profile = plan_layout(layout, context, headroom)
    cycle = result.cycle_time if result.nominal else cycle_time(simulate_plan(result.plan, profile, graph=result.graph))
    step_ms = cycle / result.refresh_steps * MS_PER_UNIT[profile.time_unit]
    packed = replace(layout, refresh_steps=result.refresh_steps)
    settings = context.layer_settings(packed, has_p_ops(result.plan))
    memory = packed_memory(
        packed,
        context.sizes,
        context.first_order,
        context.momentum,
        context.precision,
        result.plan,
        profile,
        workers,
        settings,
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
