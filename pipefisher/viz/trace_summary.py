"""Where a traced step's time went (`pipefisher viz --trace DIR --summary`), per rank and step.

From a `pipefisher run --trace` folder: the step's time on the rank's own step timer (rank 0's is
the one `pipefisher run` prints: `pipefisher.viz.trace_io.step_durations`; in a trace without
its markers, the span of the rank's ``step N`` region); the host time inside the
executor's actions by category (forward, backward, waits, the end of step...; see
`pipefisher.viz.action_figure.category`) and outside any (the executor's own work); on a GPU,
the time the device was busy (the union of its kernels, copies and sets) and its kernel count.
All times in ms. Pure Python: no torch.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pipefisher.viz.action_figure import category
from pipefisher.planning.timeline_file import StepTimes
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


def format_summary(summaries: Sequence[StepSummary], step_times: StepTimes) -> str:
    """The traced steps' times (`step_times`, e.g. ``measured steps 3, 4: 416.6, 365.1 ms; mean
    390.9 ms``), then a table per rank and step, and each step's heaviest kernels on a GPU."""
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
        if s.top_kernels:
            lines.append("  heaviest kernels [ms]: " + "; ".join(f"{name[:60]} {ms:.1f}" for name, ms in s.top_kernels))
    return "\n".join(lines)
