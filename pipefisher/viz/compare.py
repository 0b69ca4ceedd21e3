"""`pipefisher viz --compare`: several schedules, first-order or packed, on one profile, as panels
and as a table of bubble fraction, refresh interval, step time and overhead.

An entry is a schedule of the registry (`pipefisher.schedules.SCHEDULES`) or ``S+M``: S with
the profile's tasks of curvature method M (the profile's `method`) packed into its bubbles
by `pipefisher.planning.packing.pack.pack` with its default options. Every entry runs on D ranks and N
micro-batches with one profile of D stages (or of as many stages as the schedule has chunks); a
schedule with V chunks per rank gets a D-stage profile cut into V·D chunks
(`pipefisher.viz.stage_split.fit_stages`).

Per entry (`Compared`): `bubble_fraction` is the idle share of all ranks' time (0..1) of what is
drawn: the simulated step for a first-order entry (`Timeline.bubble_fraction`), the whole refresh
cycle of the packed plan for ``S+M`` (what the curvature work left idle); `step_time` the
simulated step, or the plan's mean step over its cycle (`PackResult.step_time`);
`overhead` = step_time / first-order step time of the same schedule − 1 (0 for first-order).
Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from pipefisher.core.usage import UsageError
from pipefisher.core.profile import Profile, ProfileError
from pipefisher.core.table import format_table
from pipefisher.methods.registry import method_of_profile, methods
from pipefisher.planning.packing.pack import PackResult, pack
from pipefisher.planning.simulate import Timeline, simulate
from pipefisher.schedules import SCHEDULES, get_schedule
from pipefisher.schedules.validate import validate
from pipefisher.viz.layout import Panel, packed_panel, schedule_panel
from pipefisher.viz.stage_split import fit_stages


class Entry(NamedTuple):
    """One `--compare` item: a schedule name and the curvature method whose tasks PipeFisher packs
    into its bubbles (None: first-order)."""

    schedule: str
    method: str | None = None

    @property
    def packed(self) -> bool:
        return self.method is not None

    def __str__(self) -> str:
        return self.schedule + (f"+{self.method}" if self.method else "")


def parse_entries(text: str) -> list[Entry]:
    """``1f1b,1f1b+kfac`` -> [Entry("1f1b"), Entry("1f1b", "kfac")]; UsageError naming the first
    item that is neither a registered schedule S nor S+M with M a registered method, and the choices."""
    entries = []
    for item in (part.strip() for part in text.split(",")):
        name, plus, method = item.partition("+")
        if name not in SCHEDULES or (plus and method not in methods()):
            raise UsageError(
                f"--compare: {item!r} is not a schedule S or S+M; schedules: {', '.join(sorted(SCHEDULES))}; "
                f"M packs the profile's tasks of method M: {', '.join(methods())}"
            )
        entries.append(Entry(name, method or None))
    return entries


class Setup(NamedTuple):
    """What every entry shares: D ranks, N micro-batches, and the profile's description."""

    stages: int
    micro_batches: int
    profile: str

    def __str__(self) -> str:
        return f"profile {self.profile}; D={self.stages}, N={self.micro_batches}"


@dataclass(frozen=True)
class Compared:
    """An entry's panel and its row of the table (times in `time_unit`, fractions 0..1);
    `refresh_steps` is None for first-order entries."""

    entry: Entry
    panel: Panel
    time_unit: str
    bubble_fraction: float
    step_time: float
    first_order_step_time: float
    refresh_steps: int | None = None

    @property
    def overhead(self) -> float:
        """Step time beyond the first-order step of the same schedule, as a share of it."""
        return self.step_time / self.first_order_step_time - 1 if self.first_order_step_time else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "entry": str(self.entry),
            "schedule": self.entry.schedule,
            "packed": self.entry.packed,
            "bubble_fraction": self.bubble_fraction,
            "refresh_steps": self.refresh_steps,
            "step_time": self.step_time,
            "first_order_step_time": self.first_order_step_time,
            "overhead": self.overhead,
        }


def compare(
    entries: Sequence[Entry], stages: int, micro_batches: int, profile: Profile, chunks: int | None = None
) -> list[Compared]:
    """Every entry on `stages` ranks and `micro_batches` micro-batches with `profile` (cut into
    chunks where a schedule needs them); `chunks` applies to `interleaved`. A packed entry's panel
    is its whole refresh cycle. Raises ScheduleError for an impossible shape,
    ProfileError for a profile that does not fit or has no layers to pack."""
    rows = []
    for entry in entries:
        schedule = validate(
            get_schedule(entry.schedule, stages, micro_batches, chunks if entry.schedule == "interleaved" else None)
        )
        if profile.num_stages not in (schedule.num_ranks, schedule.num_stages):
            chunked = (
                f" or {schedule.num_stages} (one per model chunk)" if schedule.num_stages != schedule.num_ranks else ""
            )
            raise ProfileError(
                f"{entry}: the profile has {profile.num_stages} stages; it needs {schedule.num_ranks} (one per rank){chunked}"
            )
        fitted = fit_stages(profile, schedule.num_stages)
        if not entry.packed:
            timeline = simulate(schedule, fitted)
            rows.append(_first_order(entry, schedule_panel(schedule, fitted, timeline), timeline))
            continue
        if not any(stage.layers for stage in fitted.stages):
            raise ProfileError(
                f"{entry}: packing needs a profile whose stages list `layers` (a curvature method's task costs); this one has none"
            )
        timed = method_of_profile(profile)
        if entry.method != timed.name:
            raise ProfileError(f"{entry}: the profile times {timed.name} tasks; write {entry.schedule}+{timed.name}")
        result = pack(schedule, fitted, timed.rules)
        rows.append(_packed(entry, packed_panel(schedule, result), result))
    return rows


def _first_order(entry: Entry, panel: Panel, timeline: Timeline) -> Compared:
    return Compared(entry, panel, timeline.time_unit, timeline.bubble_fraction, timeline.step_time, timeline.step_time)


def _packed(entry: Entry, panel: Panel, result: PackResult) -> Compared:
    return Compared(
        entry,
        panel,
        result.first_order.time_unit,
        cycle_bubble_fraction(result.timelines),
        result.step_time,
        result.first_order_step_time,
        result.refresh_steps,
    )


def cycle_bubble_fraction(timelines: Sequence[Timeline]) -> float:
    """Idle share of all ranks' time over consecutive steps, 0..1."""
    total = sum(t.step_time * t.num_ranks for t in timelines)
    idle = sum(t.bubble_time(rank) for t in timelines for rank in range(t.num_ranks))
    return idle / total if total else 0.0


def format_compare_table(rows: Sequence[Compared]) -> str:
    """Right-aligned text table (`format_table`), one line per entry; '-' marks k of first-order
    entries."""
    unit = rows[0].time_unit
    return format_table(
        ["entry", "bubble [%]", "k [steps]", f"step [{unit}]", "overhead [%]"],
        [
            (
                str(r.entry),
                f"{100 * r.bubble_fraction:.1f}",
                "-" if r.refresh_steps is None else r.refresh_steps,
                f"{r.step_time:.4g}",
                f"{100 * r.overhead:.2f}",
            )
            for r in rows
        ],
    )


def compare_to_dict(rows: Sequence[Compared], setup: Setup) -> dict[str, Any]:
    """The `--json` object: the setup, the time unit and every row (`Compared.to_dict`)."""
    return {**setup._asdict(), "time_unit": rows[0].time_unit, "entries": [r.to_dict() for r in rows]}
