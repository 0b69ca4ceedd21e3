"""Picture of one traced step with every executor action (`pipefisher viz --trace DIR --actions`).

One row per rank: each labelled region the executor opened inside the step (ops, receives,
sends, waits, collective launches, the end of step; see `pipefisher.viz.trace_io`) as a bar on
the traces' shared clock [ms from the step's earliest start], coloured by what it is, with its
label where it fits; the step's time outside any action (the executor itself) stays white.
matplotlib is imported lazily with the Agg canvas.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pipefisher.core.files import write_atomically
from pipefisher.core.ir import Op, ScheduleError
from pipefisher.core.trace_labels import PREPARE
from pipefisher.viz.figure import COLOURS
from pipefisher.planning.timeline_file import StepTimes
from pipefisher.viz.trace_io import labelled_events, step_durations, step_spans
from pipefisher.planning.timeline_file import TimelineError

#: label prefix -> (category, colour) of a communication action or the end of step
#: (the wait on the step's world reduction applies the optimizer: it is the end of step's)
OTHER = {
    "w:step": ("end of step", "#6a51a3"),
    "recv:": ("receive posted", "#bdbdbd"),
    "send:": ("send", "#7f7f7f"),
    "w:": ("wait", "#d62728"),
    "+": ("collective launched", "#222222"),
    "wsend:": ("wait", "#d62728"),
    "step end": ("end of step", "#6a51a3"),
    PREPARE: ("micro-batches built ahead", "#9ecae1"),
}
OP_CATEGORY = {
    "F": "forward",
    "B": "backward",
    "W": "weight",
    "C0": "curvature-0",
    "C1": "curvature-1",
    "S0": "sync",
    "S1": "sync",
    "R0": "refresh-0",
    "R1": "refresh-1",
    "X": "sync",
    "P": "precondition",
    "U": "fold",
    "H": "precondition",
}


@dataclass(frozen=True)
class Region:
    """One action of a rank: `start`/`end` in ms on the shared clock."""

    rank: int
    label: str
    start: float
    end: float


def step_regions(paths: Sequence[Path], step: int | None = None) -> tuple[int, list[Region]]:
    """(step, the executor's regions of every rank in it): `step` (1-based) or the first traced."""
    regions: list[Region] = []
    for rank, path in enumerate(paths):
        events = labelled_events(path)
        steps = {n: (begin, end) for begin, end, n in step_spans(events)}
        if not steps:
            raise TimelineError(f"{path}: no 'step N' region; was it written by `pipefisher run --trace`?")
        step = min(steps) if step is None else step
        if step not in steps:
            raise TimelineError(
                f"{path}: step {step} was not traced; traced steps: {', '.join(map(str, sorted(steps)))}"
            )
        begin, end = steps[step]
        regions += [
            Region(rank, e["name"], e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3)
            for e in events
            if begin < e["ts"] <= end and category(e["name"]) is not None
        ]
    if step is None:
        raise TimelineError("no trace files to draw")
    return step, regions


def category(label: str) -> tuple[str, str] | None:
    """(category, colour) of an executor label; None for torch's own regions (``gloo:send``...)."""
    for prefix, found in OTHER.items():
        if label.startswith(prefix):
            return found
    try:
        op = Op.parse(label)
    except (ScheduleError, ValueError):
        return None
    name = OP_CATEGORY.get(op.token, "forward")
    return name, COLOURS[name]


def render_actions(paths: Sequence[Path], output: Path, step: int | None = None) -> None:
    """Draw the step's actions of every rank into `output` (.png or .svg), titled with the step's
    time as `pipefisher run` printed it (`pipefisher.viz.trace_io`; a trace without it: none)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    step, regions = step_regions(paths, step)
    origin = min(r.start for r in regions)
    ranks = len(paths)
    figure = Figure(figsize=(14, 1.4 + 0.55 * ranks))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    span = max(r.end for r in regions) - origin
    seen: dict[str, str] = {}
    for region in regions:
        found = category(region.label)
        if found is None:  # `step_regions` keeps only the labels that have one
            continue
        name, colour = found
        seen[name] = colour
        left, width = region.start - origin, region.end - region.start
        axes.barh(region.rank, width, left=left, height=0.7, color=colour, edgecolor="white", linewidth=0.3)
        if width > 0.035 * span:
            axes.text(
                left + width / 2,
                region.rank,
                region.label,
                ha="center",
                va="center",
                fontsize=5.5,
                clip_on=True,
                color="black" if name == "receive posted" else "white",
            )
    axes.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    axes.invert_yaxis()
    axes.set_xlim(0, span)
    axes.set_xlabel("time from the step's start [ms]")
    ms = step_durations(labelled_events(paths[0])).get(step)
    time = f"step {step}" if ms is None else str(StepTimes((step,), (ms,), "ms"))
    axes.set_title(f"{time}; every action the executor performed (labels from the profiler trace)", fontsize=9)
    figure.legend(
        handles=[Patch(color=c, label=n) for n, c in seen.items()],
        loc="lower center",
        ncol=min(len(seen), 8),
        fontsize=7,
        frameon=False,
    )
    figure.tight_layout(rect=(0, 0.1, 1, 1))
    write_atomically(output, lambda temporary: figure.savefig(temporary, dpi=150))
