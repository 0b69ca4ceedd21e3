"""Where a traced step's time went (`pipefisher viz --trace DIR --summary`), per rank and step.

From a `pipefisher run --trace` folder: the step's time on the rank's own step timer (rank 0's is
the one `pipefisher run` prints: `pipefisher.viz.trace_io.step_durations`; in a trace without
its markers, the span of the rank's ``step N`` region); the host time inside the
executor's actions by category (forward, backward, waits, the end of step...; see
`pipefisher.viz.action_figure.category`) and outside any (the executor's own work); on a GPU,
the time the device was busy (the union of its kernels, copies and sets) and its kernel count;
and, where the run has a curvature method, the method's work on the rank (`method_attribution`):
its time in method ops (curvature, refresh, preconditioning), split into hidden (run where the
first-order step on the trace's own op times leaves the rank idle) and exposed (on the step's
critical path: how much later the rank ends than the first-order step), as
`pipefisher.planning.packing.exposed.MethodShare` defines them, on simulated steps.
All times in ms. Pure Python: no torch.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pipefisher.core.ir import Op, Schedule
from pipefisher.core.profile import Profile, StageProfile
from pipefisher.planning.packing.exposed import MeasuredDurations, MethodShare, method_shares, op_samples
from pipefisher.planning.simulate import COLLECTIVES, simulate_graph, simulate_ops
from pipefisher.planning.timeline_file import RecordedTimeline, StepTimes
from pipefisher.schedules.validate import StageDependencies, schedule_graph
from pipefisher.viz.action_figure import category
from pipefisher.viz.trace_io import load_events, step_durations, step_spans

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass(frozen=True)
class StepSummary:
    """One rank's traced step; times in ms; `device_busy` None without device activity."""

    rank: int
    step: int
    wall: float
    actions: dict[str, float] = field(default_factory=dict)
    device_busy: float | None = None
    kernels: int = 0
    top_kernels: tuple[tuple[str, float], ...] = ()

    @property
    def outside_actions(self) -> float:
        return self.wall - sum(self.actions.values())


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def summarise(paths: Sequence[Path]) -> list[StepSummary]:
    """Every rank's traced steps, in rank then step order."""
    found = []
    for rank, path in enumerate(paths):
        events = [e for e in load_events(path) if e.get("ph") == "X"]
        labelled = [e for e in events if e.get("cat") == "user_annotation"]
        device = [e for e in events if e.get("cat") in DEVICE_CATEGORIES]
        timed = step_durations(labelled)
        for begin, end, step in step_spans(labelled):
            actions: dict[str, float] = defaultdict(float)
            for event in labelled:
                kind = category(event["name"]) if begin < event["ts"] <= end else None
                if kind is not None:
                    actions[kind[0]] += event["dur"] / 1e3
            inside = [e for e in device if begin <= e["ts"] <= end]
            kernels = [e for e in inside if e["cat"] == "kernel"]
            per_kernel: dict[str, float] = defaultdict(float)
            for kernel in kernels:
                per_kernel[kernel["name"]] += kernel["dur"] / 1e3
            top = tuple(sorted(per_kernel.items(), key=lambda item: -item[1])[:5])
            busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in inside]) / 1e3 if device else None
            found.append(
                StepSummary(rank, step, timed.get(step, (end - begin) / 1e3), dict(actions), busy, len(kernels), top)
            )
    return found


def _traced_schedule(record: RecordedTimeline) -> Schedule | None:
    """The schedule of a recording: each rank's forward, backward and weight-gradient ops of its
    first step, in the order the rank ran them; None where a stage ran on more than one traced
    rank (data-parallel replicas) or there are none."""
    placement: dict[tuple[int, int], int] = {}
    ranks = []
    for rank, intervals in enumerate(record.steps[0].ranks):
        ops = tuple(iv.op for iv in sorted(intervals, key=lambda iv: iv.start) if iv.op.kind.is_compute)
        for op in ops:
            if placement.setdefault((op.pipe, op.stage), rank) != rank:
                return None
        ranks.append(ops)
    if not placement:
        return None
    return Schedule(
        name="traced",
        num_stages=1 + max(stage for _, stage in placement),
        num_micro_batches=1 + max(op.micro_batch or 0 for ops in ranks for op in ops),
        placement=placement,
        ranks=tuple(ranks),
        num_pipes=1 + max(pipe for pipe, _ in placement),
    )


def method_attribution(record: RecordedTimeline) -> dict[tuple[int, int], MethodShare]:
    """(rank, step) -> the rank's method work in that traced step: `method`, the time its method
    ops took there; `exposed`, at most that, how much later the rank ends than the first-order
    step when both are simulated on the step's own op times (medians per kind, stage, layer and
    part; no transfer or end-of-step time, which the trace does not time): with the method, each
    rank's ops in the order it ran them, method ops after the op before them on their rank only
    (exchanges between ranks left out); first-order, the forward, backward and weight-gradient
    ops alone (`_traced_schedule`). Empty without method ops or a schedule."""
    schedule = _traced_schedule(record)
    if schedule is None:
        return {}
    profile = Profile(stages=(StageProfile(0.0, 0.0),) * schedule.num_stages, time_unit=record.steps[0].time_unit)
    compute = StageDependencies(schedule.num_stages)

    def dependencies(op: Op) -> tuple[Op, ...]:
        return compute(op) if op.kind.is_compute else ()

    shares = {}
    for step_id, step in zip(record.step_ids, record.steps):
        samples = op_samples(iv for intervals in step.ranks for iv in intervals)
        durations = MeasuredDurations(profile, samples, schedule.splits_backward)
        first_order = simulate_graph(schedule_graph(schedule), durations, schedule.name)
        ranks = [
            [iv.op for iv in sorted(intervals, key=lambda iv: iv.start) if iv.op.kind not in COLLECTIVES]
            for intervals in step.ranks
        ]
        simulated = method_shares(simulate_ops(ranks, dependencies, durations, schedule.name), first_order)
        for rank, intervals in enumerate(step.ranks):
            method = sum(iv.duration for iv in intervals if not iv.op.kind.is_compute)
            shares[(rank, step_id)] = MethodShare(rank, method, min(method, simulated[rank].exposed))
    return shares if any(share.method > 0 for share in shares.values()) else {}


def format_summary(
    summaries: Sequence[StepSummary], step_times: StepTimes, shares: Mapping[tuple[int, int], MethodShare] | None = None
) -> str:
    """The traced steps' times (`step_times`, e.g. ``measured steps 3, 4: 416.6, 365.1 ms; mean
    390.9 ms``), then a table per rank and step (with the method's work of `shares`:
    `method_attribution`), and each step's heaviest kernels on a GPU."""
    lines = [f"measured {step_times}"]
    for s in summaries:
        parts = ", ".join(f"{name} {ms:.1f}" for name, ms in sorted(s.actions.items(), key=lambda item: -item[1]))
        device = (
            ""
            if s.device_busy is None
            else f"; device busy {s.device_busy:.1f} ms ({100 * s.device_busy / s.wall:.0f} %), {s.kernels} kernels"
        )
        lines.append(f"rank {s.rank} step {s.step}: {s.wall:.1f} ms{device}")
        lines.append(f"  host time in actions [ms]: {parts}; outside any action {s.outside_actions:.1f}")
        share = shares.get((s.rank, s.step)) if shares else None
        if share is not None:
            lines.append(
                f"  method work {share.method:.1f} ms ({100 * share.method / s.wall:.1f} % of the step): "
                f"hidden {share.hidden:.1f} ms, exposed {share.exposed:.1f} ms ({100 * share.exposed / s.wall:.1f} % of the step)"
            )
        if s.top_kernels:
            lines.append("  heaviest kernels [ms]: " + "; ".join(f"{name[:60]} {ms:.1f}" for name, ms in s.top_kernels))
    return "\n".join(lines)
