"""Turn a schedule, a curvature method's packing or a recorded timeline into a `Panel`: rows of
boxes per rank. A packing's method names its own work in the legends (`WorkLabels`).

The renderers (text, Chrome trace, figure) draw panels and know nothing of simulation or
packing. Times stay in the profile's (or recording's) time unit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from pipefisher.core.ir import Op, OpKind, Schedule
from pipefisher.core.profile import Profile, ProfileError
from pipefisher.planning.packing.pack import PackOptions, PackResult, pack
from pipefisher.planning.simulate import Bubble, Timeline, simulate
from pipefisher.planning.timeline_file import RecordedTimeline, StepTimes
from pipefisher.planning.vocabulary import TaskRules, WorkLabels

#: Colour class of every op kind; a curvature or refresh op's is its kind's with its part
#: (`category`); the renderers key their colours and characters on it.
CATEGORY: dict[OpKind, str] = {
    OpKind.FORWARD: "forward",
    OpKind.BACKWARD: "backward",
    OpKind.WEIGHT: "weight",
    OpKind.CURVATURE: "curvature",
    OpKind.SYNC: "sync",
    OpKind.EXCHANGE: "sync",
    OpKind.REFRESH: "refresh",
    OpKind.PRECONDITION: "precondition",
    OpKind.FOLD: "fold",
    OpKind.HELP: "precondition",  # a layer's share of another rank's stage's precondition
}

#: Categories in legend order, with their legend text where no method names its work.
CATEGORY_NAMES: dict[str, str] = {
    "forward": "forward",
    "backward": "backward",
    "weight": "weight gradient W (split from the backward)",
    "curvature-0": "curvature of part 0",
    "curvature-1": "curvature of part 1",
    "sync": "sync / exchange",
    "refresh-0": "refresh of part 0",
    "refresh-1": "refresh of part 1",
    "precondition": "precondition",
    "fold": "statistics fold",
}


def category(op: Op) -> str:
    """The colour class of `op`: ``curvature-1`` for curvature of part 1, ``refresh-0``, ``sync``..."""
    name = CATEGORY[op.kind]
    return name if op.part is None or op.kind is OpKind.SYNC else f"{name}-{op.part}"


def category_names(labels: WorkLabels | None) -> dict[str, str]:
    """`CATEGORY_NAMES` in the words of the method `labels` are of (None: the generic ones)."""
    if labels is None:
        return dict(CATEGORY_NAMES)
    names = dict(CATEGORY_NAMES, precondition=labels.precondition, fold=labels.fold)
    for part, label in enumerate(labels.parts):
        names[f"curvature-{part}"] = f"curvature ({label})"
        names[f"refresh-{part}"] = labels.part_work(part)
    return names


@dataclass(frozen=True, slots=True)
class Box:
    """`op` of step `step` runs on `rank` from `start` to `end` (panel time unit, panel axis).

    `variant` is the pipe (Chimera) or model chunk (interleaved), 0 otherwise; `label` is the
    short text a renderer may print inside the box (micro-batch, or the K-FAC kind).
    """

    rank: int
    start: float
    end: float
    op: Op
    step: int
    category: str
    variant: int
    label: str


@dataclass(frozen=True)
class Panel:
    """One schedule (or recording) on a time axis from 0 to `end`, in `time_unit`.

    Step `step_ids[j]` begins at `step_starts[j]`; `bubbles` are every rank's idle gaps within
    its steps, `step_ends` every rank's end of step after its last op (gradient all-reduce,
    optimizer step; from the profile's `step_end`). `step_time` is the mean over the steps (for a
    recording, of its `step_times`: each step's time as the run measured it, or its stated
    stand-in; the title lists them); `bubble_fraction` is the first-order
    schedule's idle share (0..1) for planned panels, the recorded idle share otherwise.
    `method` (the curvature method's label), `labels` (its names of its work), `refresh_steps`
    and `utilization` (0..1) are set for packings; `drawn_steps`, when set,
    says the panel holds only its first that many steps (see `first_steps`).
    """

    name: str
    time_unit: str
    num_ranks: int
    boxes: tuple[Box, ...]
    bubbles: tuple[Bubble, ...]
    step_starts: tuple[float, ...]
    step_ids: tuple[int, ...]
    end: float
    step_time: float
    bubble_fraction: float
    micro_batches: int | None = None
    chunks: int | None = None
    first_order_step_time: float | None = None
    refresh_steps: int | None = None
    utilization: float | None = None
    step_ends: tuple[Bubble, ...] = ()
    method: str = ""
    labels: WorkLabels | None = None
    drawn_steps: int | None = None
    step_times: StepTimes | None = None

    @property
    def title(self) -> str:
        """One line: name, shape, step time (a recording's: each step's and their mean, as
        `StepTimes` writes them), bubble fraction and, for packings, k and utilisation."""
        shape = [f"D={self.num_ranks}"]
        if self.micro_batches is not None:
            shape.append(f"N={self.micro_batches}")
        if self.chunks is not None:
            shape.append(f"v={self.chunks}")
        if self.micro_batches is None and len(self.step_ids) > 1:
            shape.append(f"{len(self.step_ids)} steps")
        unit = self.time_unit
        notes = ["mean"] if len(self.step_ids) > 1 else []
        if self.first_order_step_time is not None:
            notes.append(f"first-order {self.first_order_step_time:.4g} {unit}")
        if self.step_times is not None:
            figures = [str(self.step_times)]
        else:
            figures = [f"step {self.step_time:.4g} {unit}" + (f" ({'; '.join(notes)})" if notes else "")]
        first_order = "first-order " if self.first_order_step_time is not None else ""
        figures.append(f"{first_order}bubble {100 * self.bubble_fraction:.1f} %")
        if self.refresh_steps is not None:
            figures.append(f"{self.method} refresh every {self.refresh_steps} steps".lstrip())
        if self.utilization is not None:
            figures.append(f"bubble utilisation {100 * self.utilization:.1f} %")
        if self.drawn_steps is not None:
            figures.append(f"first {self.drawn_steps} steps drawn")
        return f"{self.name}: {', '.join(shape)}; {'; '.join(figures)}"

    @property
    def categories(self) -> list[str]:
        """Categories of the boxes, in legend order."""
        present = {box.category for box in self.boxes}
        return [c for c in CATEGORY_NAMES if c in present]

    @property
    def category_names(self) -> dict[str, str]:
        """Legend text of its categories, in its method's words (`category_names`)."""
        return category_names(self.labels)


def schedule_panel(schedule: Schedule, profile: Profile, timeline: Timeline | None = None) -> Panel:
    """One step of `schedule` as simulated with `profile` (`timeline`: that simulation, if done already)."""
    if timeline is None:
        timeline = simulate(schedule, profile)
    return _panel(
        schedule.name,
        [timeline],
        [0.0],
        [0],
        num_pipes=schedule.num_pipes,
        chunked=is_chunked(schedule),
        step_time=timeline.step_time,
        bubble_fraction=timeline.bubble_fraction,
        micro_batches=schedule.num_micro_batches,
        chunks=schedule.params.get("chunks"),
    )


def curvature_panel(
    schedule: Schedule, profile: Profile, rules: TaskRules, options: PackOptions | None = None
) -> Panel:
    """A whole refresh cycle of `schedule` with the curvature method of `rules` (K-FAC, Shampoo;
    the method whose times `profile` holds) packed into its bubbles, steps end to end.

    Raises ProfileError when `profile` lists no layers.
    """
    if not any(stage.layers for stage in profile.stages):
        raise ProfileError(
            "packing needs a profile whose stages list `layers` (a curvature method's task costs); this one has none"
        )
    return packed_panel(schedule, pack(schedule, profile, rules, options))


def packed_panel(schedule: Schedule, result: PackResult) -> Panel:
    """The refresh cycle of `result`, a packing of `schedule`, steps end to end."""
    starts = [sum(t.step_time for t in result.timelines[:j]) for j in range(len(result.timelines))]
    labels = result.plan.task_rules().labels
    return _panel(
        f"{schedule.name} + PipeFisher",
        result.timelines,
        starts,
        list(range(len(result.timelines))),
        num_pipes=schedule.num_pipes,
        chunked=is_chunked(schedule),
        step_time=result.step_time,
        bubble_fraction=result.first_order.bubble_fraction,
        micro_batches=schedule.num_micro_batches,
        chunks=schedule.params.get("chunks"),
        first_order_step_time=result.first_order_step_time,
        refresh_steps=result.refresh_steps,
        utilization=result.bubble_utilization,
        method=labels.method or result.plan.method,
        labels=labels,
    )


def recorded_panel(record: RecordedTimeline, name: str) -> Panel:
    """A recording, drawn from its first step's start, titled with its `measured` step times; pipes and chunks are read off the ops
    (a stage beyond the rank count without pipes means interleaved chunks)."""
    ops = [iv.op for step in record.steps for ivs in step.ranks for iv in ivs]
    num_pipes = 1 + max((op.pipe for op in ops), default=0)
    chunked = num_pipes == 1 and any(op.stage >= record.num_ranks for op in ops)
    origin = record.starts[0]
    busy = sum(step.busy_time(rank) for step in record.steps for rank in range(step.num_ranks))
    total = sum(step.step_time * step.num_ranks for step in record.steps)
    measured = record.measured
    return _panel(
        name,
        record.steps,
        [start - origin for start in record.starts],
        record.step_ids,
        num_pipes=num_pipes,
        chunked=chunked,
        step_time=measured.mean,
        step_times=measured,
        bubble_fraction=1 - busy / total if total > 0 else 0.0,
    )


def first_steps(panel: Panel, steps: int) -> Panel:
    """`panel` (a refresh cycle, a recording) cut after its first `steps` (>= 1) steps, or `panel`
    itself if it has no more; the summary (mean step time, k, utilisation, bubble) stays that of
    the whole panel."""
    if len(panel.step_ids) <= steps:
        return panel
    end = panel.step_starts[steps]
    kept = set(panel.step_ids[:steps])
    return replace(
        panel,
        boxes=tuple(b for b in panel.boxes if b.step in kept),
        bubbles=tuple(b for b in panel.bubbles if b.start < end),
        step_ends=tuple(e for e in panel.step_ends if e.start < end),
        step_starts=panel.step_starts[:steps],
        step_ids=panel.step_ids[:steps],
        end=end,
        drawn_steps=steps,
    )


def is_chunked(schedule: Schedule) -> bool:
    """Whether a rank of the (single-pipe) schedule holds several model chunks (interleaved,
    V-shape): stage = chunk · ranks + position, whichever rank the placement puts it on."""
    return schedule.num_pipes == 1 and schedule.num_stages > schedule.num_ranks


def op_label(op: Op, num_ranks: int, num_pipes: int, chunked: bool) -> tuple[int, str]:
    """(variant, label) of `op`: forward, backward and weight gradient show the micro-batch,
    prefixed with the pipe (``p1:3``) or the chunk (``c1:3``; chunk = stage // ranks, also for
    V-shape placements); a method's ops show their kind and part (``R0``)."""
    variant = op.pipe if num_pipes > 1 else (op.stage // num_ranks if chunked else 0)
    if not op.kind.is_compute:
        return variant, op.token
    prefix = f"p{op.pipe}:" if num_pipes > 1 else (f"c{variant}:" if chunked else "")
    return variant, f"{prefix}{op.micro_batch}"


def _panel(
    name: str,
    timelines: Sequence[Timeline],
    starts: Sequence[float],
    step_ids: Sequence[int],
    *,
    num_pipes: int,
    chunked: bool,
    **summary: Any,
) -> Panel:
    """Boxes and bubbles of `timelines[j]` shifted by `starts[j]`; `summary` are Panel fields."""
    num_ranks = max(t.num_ranks for t in timelines)
    boxes: list[Box] = []
    bubbles: list[Bubble] = []
    step_ends: list[Bubble] = []
    labels: dict[Op, tuple[int, str]] = {}
    for timeline, offset, step in zip(timelines, starts, step_ids):
        for rank, intervals in enumerate(timeline.ranks):
            for iv in intervals:
                if iv.op not in labels:
                    labels[iv.op] = op_label(iv.op, num_ranks, num_pipes, chunked)
                variant, label = labels[iv.op]
                boxes.append(
                    Box(rank, offset + iv.start, offset + iv.end, iv.op, step, category(iv.op), variant, label)
                )
            bubbles.extend(Bubble(rank, offset + b.start, offset + b.end) for b in timeline.idle_gaps(rank))
            if timeline.tail(rank) > 0:
                start = offset + timeline.tail_start(rank)
                step_ends.append(Bubble(rank, start, start + timeline.tail(rank)))
    return Panel(
        name=name,
        time_unit=timelines[0].time_unit,
        num_ranks=num_ranks,
        boxes=tuple(boxes),
        bubbles=tuple(bubbles),
        step_ends=tuple(step_ends),
        step_starts=tuple(starts),
        step_ids=tuple(step_ids),
        end=max(offset + t.step_time for t, offset in zip(timelines, starts)),
        **summary,
    )
