"""What a packing reports: per-device and overall refresh interval, times and utilisation."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

from pipefisher.core.ir import Op, OpKind
from pipefisher.core.profile import Profile
from pipefisher.planning.memory.captures import CapturePeak
from pipefisher.planning.plan import Plan, moved_weights
from pipefisher.planning.simulate import Timeline
from pipefisher.planning.tasks import CYCLE_KINDS, CurvatureTasks, TaskGraph

from pipefisher.planning.packing.options import PackOptions


@dataclass(frozen=True)
class DeviceReport:
    """Per-rank figures; times in the profile's unit, per step unless said otherwise."""

    rank: int
    refresh_steps: int
    lower_bound: int
    curvature_work: float
    precondition_time: float
    bubble_time: float
    bubble_utilization: float
    #: weight gradients (over the cycle's steps) the plan runs elsewhere among the forward/backward
    #: ops than the schedule (`plan.moved_weights`)
    moved_weights: int = 0
    #: per-step precondition time that fits no bubble of the rank and runs after its step's work
    #: (1F1B's stage 0: its gradient is final at the step's last backward)
    precondition_outside: float = 0.0

    @property
    def work_ratio(self) -> float:
        """Cycle K-FAC work over one step's bubble time."""
        return self.curvature_work / self.bubble_time if self.bubble_time > 0 else math.inf


@dataclass(frozen=True)
class FrontierPoint:
    """The best plan found at one refresh interval: its overhead (share of the first-order step
    time), its mean step time (profile time unit) and the placement that produced it."""

    refresh_steps: int
    overhead: float
    step_time: float
    placement: str


@dataclass(frozen=True)
class PackResult:
    """A packing: the chosen plan and its predicted timelines, the frontier it was chosen from and
    why (`reason`), which placement produced it, and the captures it holds per device (`memory`:
    what a capture cap changed, empty if nothing)."""

    plan: Plan
    #: computes the predicted timelines of the plan's steps (on first use of `timelines`)
    simulated: Callable[[], list[Timeline]] = field(repr=False, compare=False)
    #: predicted time of one refresh cycle (profile time unit)
    cycle_time: float
    first_order: Timeline
    #: the first-order step without the method's own work in the end of step
    #: (`pipefisher.planning.packing.exposed.first_order_step_time`)
    plain_first_order_step_time: float
    precondition_step_time: float
    lower_bound: int
    devices: list[DeviceReport]
    options: PackOptions
    #: the profile the plan's times are of, at its nominal times (with the P ops' work in the step
    #: end where the packer left them out, `pipefisher.planning.packing.step_end`)
    profile: Profile
    unplaceable: tuple[Op, ...] = field(default=())
    frontier: tuple[FrontierPoint, ...] = field(default=())
    reason: str = ""
    placement: str = ""
    capture_peaks: tuple[CapturePeak, ...] = field(default=())
    memory: str = ""
    #: the task graph the plan was packed and simulated on (None: the plan's own, `Plan.graph`):
    #: simulating the plan on it gives the same timelines, at the cost of steps simulated before
    graph: TaskGraph | None = field(default=None, repr=False, compare=False)
    #: whether `cycle_time` is every step of the plan simulated at the profile's own times (no
    #: task time moved to a percentile of its samples): then it is `simulate_plan`'s cycle on the
    #: profile, and callers need not simulate it again
    nominal: bool = False

    @cached_property
    def timelines(self) -> list[Timeline]:
        """Predicted timeline of every step of the cycle (simulated on first use)."""
        return self.simulated()

    @property
    def refresh_steps(self) -> int:
        return self.plan.refresh_steps

    @property
    def first_order_step_time(self) -> float:
        return self.first_order.step_time

    @property
    def step_time(self) -> float:
        """Mean step time over the cycle, K-FAC included."""
        return self.cycle_time / self.refresh_steps

    @property
    def overhead(self) -> float:
        """Packing overhead: mean step time beyond first-order + preconditioning, as a share of the
        first-order step time."""
        return (self.step_time - self.precondition_step_time) / self.first_order_step_time

    @property
    def exposed_share(self) -> float:
        """Exposed optimizer time, predicted: the mean step time over the refresh cycle with all
        of the method's work (curvature, refresh, preconditioning, waits on its collectives, its
        work in the end of step) over the first-order step of the same schedule and layout
        (`plain_first_order_step_time`), minus 1 (0.02: the method adds 2 %)."""
        return self.step_time / self.plain_first_order_step_time - 1

    @property
    def bubble_utilization(self) -> float:
        total = sum(d.bubble_time for d in self.devices) * self.refresh_steps
        used = sum(d.bubble_utilization * d.bubble_time for d in self.devices) * self.refresh_steps
        return used / total if total > 0 else 0.0

    @property
    def moved_weights(self) -> int:
        """Weight gradients the plan moved, over all devices and the cycle's steps."""
        return sum(d.moved_weights for d in self.devices)

    @property
    def capture_peak_bytes(self) -> int:
        """The most capture bytes any device holds at once over the cycle (0: sizes unknown)."""
        return max((peak.bytes for peak in self.capture_peaks), default=0)

    def to_dict(self) -> dict:
        unit = self.first_order.time_unit
        peaks = {peak.rank: peak.bytes for peak in self.capture_peaks}
        return {
            "method": self.plan.method,
            "schedule": self.plan.schedule.name,
            "stages": self.plan.schedule.num_ranks,
            "micro_batches": self.plan.schedule.num_micro_batches,
            "data_parallel": self.options.data_parallel,
            "strategy": self.options.strategy,
            "split": self.options.split,
            "margin": self.options.margin,
            "percentile": self.options.percentile,
            "max_refresh_steps": self.options.max_refresh_steps,
            "max_capture_mb": self.options.max_capture_mb,
            "time_unit": unit,
            "refresh_steps": self.refresh_steps,
            "lower_bound": self.lower_bound,
            "first_order_step_time": self.first_order_step_time,
            "plain_first_order_step_time": self.plain_first_order_step_time,
            "precondition_step_time": self.precondition_step_time,
            "step_time": self.step_time,
            "overhead": self.overhead,
            "exposed_share": self.exposed_share,
            "bubble_utilization": self.bubble_utilization,
            "reason": self.reason,
            "placement": self.placement,
            "frontier": [
                {
                    "refresh_steps": p.refresh_steps,
                    "overhead": p.overhead,
                    "step_time": p.step_time,
                    "placement": p.placement,
                }
                for p in self.frontier
            ],
            "capture_peak_mib": self.capture_peak_bytes / 2**20,
            "memory": self.memory,
            "unplaceable": [str(op) for op in self.unplaceable],
            "move_weights": self.options.move_weights,
            "moved_weights": self.moved_weights,
            "devices": [
                {
                    "rank": d.rank,
                    "refresh_steps": d.refresh_steps,
                    "lower_bound": d.lower_bound,
                    "curvature_work": d.curvature_work,
                    "precondition_time": d.precondition_time,
                    "precondition_outside": d.precondition_outside,
                    "bubble_time": d.bubble_time,
                    "work_ratio": d.work_ratio if math.isfinite(d.work_ratio) else None,
                    "bubble_utilization": d.bubble_utilization,
                    "capture_peak_mib": peaks.get(d.rank, 0) / 2**20,
                    "moved_weights": d.moved_weights,
                }
                for d in self.devices
            ],
        }


def device_reports(
    tasks: CurvatureTasks,
    first_order: Timeline,
    plan: Plan,
    leftovers: list[Op],
    precondition_in_bubbles: Callable[[int], float],
    bounds: list[int],
) -> list[DeviceReport]:
    """Per-rank figures of a packed plan; `leftovers` are the tasks that run outside bubbles. A
    rank's per-step work is its precondition and fold ops', less the layers other ranks help with,
    and its help ops' (`OpKind.HELP`); what of its own precondition no bubble holds runs after the
    step's work."""
    durations = tasks.durations.helping(plan.helped)
    k = plan.refresh_steps
    outside = set(leftovers)
    moved = moved_weights(plan)
    reports = []
    for rank in range(tasks.schedule.num_ranks):
        steps_used = [
            j
            for j, step in enumerate(plan.steps)
            if any(op.kind in CYCLE_KINDS and op not in outside for op in step[rank])
        ]
        work = sum(tasks.cycle_work[rank])
        own = sum(durations(op) for op in tasks.per_step[rank])
        precondition = own + sum(durations(op) for op in plan.steps[0][rank] if op.kind is OpKind.HELP)
        bubble = first_order.bubble_time(rank)
        outside_work = sum(w for op, w in zip(tasks.cycle[rank], tasks.cycle_work[rank]) if op in outside)
        precondition_inside = precondition_in_bubbles(rank)
        in_bubbles = work - outside_work + precondition_inside * k
        reports.append(
            DeviceReport(
                rank=rank,
                refresh_steps=1 + max(steps_used, default=0),
                lower_bound=bounds[rank],
                curvature_work=work,
                precondition_time=precondition,
                bubble_time=bubble,
                bubble_utilization=min(1.0, in_bubbles / (bubble * k)) if bubble > 0 else 0.0,
                moved_weights=moved[rank],
                precondition_outside=max(0.0, own - precondition_inside),
            )
        )
    return reports
