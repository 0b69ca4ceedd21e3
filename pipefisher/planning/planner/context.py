"""What every prediction of one search shares (`PlanContext`) and the time sources it reads.
Pure Python: no torch."""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipefisher.config import FIRST_ORDER
from pipefisher.methods.registry import task_rules
from pipefisher.methods.settings import RefreshConfig
from pipefisher.planning.memory.activations import PRECISIONS
from pipefisher.planning.planner.candidates import Layout, stage_replicas
from pipefisher.planning.planner.flop_times import FlopTimes
from pipefisher.planning.planner.hardware import Hardware, Link
from pipefisher.planning.planner.layer_models import LayerSettings, layer_settings
from pipefisher.planning.planner.links import data_parallel_link
from pipefisher.planning.planner.model_sizes import ModelSizes
from pipefisher.planning.planner.sources import MeasuredTimes, ReferenceTimes, measured_bandwidth_gbps

TimeSource = ReferenceTimes | MeasuredTimes | FlopTimes
#: data-parallel all-reduce bandwidth assumed (GB/s, nccl-tests' busbw), a round figure for
#: 100 Gb/s InfiniBand between nodes; `--dp-bandwidth-gbps` sets it
DEFAULT_DP_BANDWIDTH_GBPS = 10.0


def is_curvature(method: str) -> bool:
    return method not in FIRST_ORDER


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

    def workers_per_layer(self, layout: Layout) -> int | None:
        """Gradient workers per layer of `layout`'s curvature method, as its run would have them
        (`RefreshConfig.workers_per_layer`); None: every replica, or no curvature method."""
        if self.section is None or not is_curvature(layout.method):
            return None
        return self.section.workers_per_layer(stage_replicas(layout), layout.zero)

    def precondition_op(self, layout: Layout) -> bool:
        """Whether `layout`'s stages have their method's per-step P op, as its run would
        (`RefreshConfig.precondition_op`); True without a curvature method."""
        if self.section is None or not is_curvature(layout.method):
            return True
        return self.section.precondition_op(stage_replicas(layout), layout.zero)

    def layer_settings(self, layout: Layout, p_ops: bool = False) -> LayerSettings:
        """What the section sets of `layout`'s method's layer memory model (`layer_settings`);
        `p_ops`: its plan has the method's P ops (a packed plan's; before packing, the least: none)."""
        if not is_curvature(layout.method):
            return ()
        return layer_settings(layout.method, self.section, p_ops)

    def without_p_ops(self, layout: Layout) -> PlanContext | None:
        """This context as it times `layout` run without its method's optional P ops
        (`TaskRules.step_end_precondition`; `pack_choosing_p_ops` packs both): a flop model with the
        section's helpers off, whose counts give that work to the step end; None where the layout
        has no such P ops or its source measured them (their times then move into the step end as
        measured, the packer's default)."""
        if not isinstance(self.source, FlopTimes) or self.section is None or not is_curvature(layout.method):
            return None
        if not (self.precondition_op(layout) and task_rules(layout.method).step_end_precondition):
            return None
        section = replace(self.section, helpers=False)
        return replace(self, section=section, source=replace(self.source, section=section, _cache={}))

    def data_parallel_link(self, layout: Layout) -> Link:
        """The link of `layout`'s data-parallel traffic (`links.data_parallel_link`)."""
        return data_parallel_link(layout, self.hardware, self.dp_bandwidth_gbps, self.dp_bandwidth_set)


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
