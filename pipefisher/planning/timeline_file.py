"""The recorded-timeline format `pipefisher.timeline/v2`: what ran on every rank, and when.

A file holds one JSON object::

    {"schema": "pipefisher.timeline/v2", "name": "tiny-cpu 1f1b", "time_unit": "ms",
     "step_starts": [0.0, 11.3],
     "ranks": [[{"op": "0F0", "start": 0.0, "end": 1.2, "step": 0}, ...], ...]}

`ranks[r]` lists rank r's ops (string form of `pipefisher.core.ir.Op`, version 2: a method's ops
carry their part, ``2R1:block0.fc1``) with start/end on one clock
shared by all ranks (any origin, in `time_unit`: s, ms, us or units). `step` (optional, default
0) is the training step an op belongs to; `step_starts` (optional) gives each step's start, in
the order of the sorted step indices, and defaults to the earliest start among the step's ops.
`step_times` (optional, same order, in `time_unit`) is each step's wall-clock time as the run
timed it (`pipefisher viz --trace` writes rank 0's `step N` region, the interval `pipefisher run`
prints as the step time); without it a step's time is the span from its start to its last op's
end, which leaves out the end of step (gradient all-reduce, optimizer step), and says so
(`StepTimes.basis`). `name` is optional. The profiler writes this format; `pipefisher viz
--timeline` draws it. Version 1 files (`pipefisher.timeline/v1`, the same fields with ops in the
v1 string form, ``2IB:block0.fc1``) are read as well.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipefisher.core.files import load_structured, write_text_atomically
from pipefisher.core.ir import Op, ScheduleError
from pipefisher.core.profile import TIME_UNITS, ProfileError
from pipefisher.planning.simulate import Interval, Timeline

SCHEMA = "pipefisher.timeline/v2"
SCHEMA_V1 = "pipefisher.timeline/v1"
#: `StepTimes.basis` of a recording without `step_times`
OP_SPAN = "step start to last op"
#: `StepTimes` lists each step's time up to this many steps, and their mean, min and max beyond
MAX_LISTED = 6


class TimelineError(ProfileError):
    """A recorded timeline is malformed (a ProfileError, so the CLI reports it in one line)."""


@dataclass(frozen=True)
class StepTimes:
    """Step `step_ids[j]` took `times[j]` (in `time_unit`); `basis` is "" for the step's wall-clock
    time as the run timed it, else what was timed instead (`OP_SPAN`)."""

    step_ids: tuple[int, ...]
    times: tuple[float, ...]
    time_unit: str
    basis: str = ""

    def __post_init__(self) -> None:
        if not self.times or len(self.times) != len(self.step_ids):
            raise TimelineError("step times need one time per step, and at least one step")

    @property
    def mean(self) -> float:
        return sum(self.times) / len(self.times)

    def number(self, value: float) -> str:
        """`value` in ms to 0.1, as `pipefisher run` prints a step time; other units to 4 digits."""
        return f"{value:.1f}" if self.time_unit == "ms" else f"{value:.4g}"

    def format(self, value: float) -> str:
        """`number(value)` and the unit."""
        return f"{self.number(value)} {self.time_unit}"

    def __str__(self) -> str:
        """``step 3: 416.6 ms``, ``steps 3, 4: 416.6, 365.1 ms; mean 390.9 ms`` or, beyond
        `MAX_LISTED` steps, ``steps 1..50: mean 27.0 ms (min 25.1 ms, max 30.2 ms)``; a basis
        follows the step numbers in parentheses."""
        basis = f" ({self.basis})" if self.basis else ""
        if len(self.times) == 1:
            return f"step {self.step_ids[0]}{basis}: {self.format(self.times[0])}"
        mean = self.format(self.mean)
        if len(self.times) > MAX_LISTED:
            return (
                f"steps {self.step_ids[0]}..{self.step_ids[-1]}{basis}: mean {mean} "
                f"(min {self.format(min(self.times))}, max {self.format(max(self.times))})"
            )
        values = ", ".join(self.number(t) for t in self.times)
        return f"steps {', '.join(map(str, self.step_ids))}{basis}: {values} {self.time_unit}; mean {mean}"


@dataclass(frozen=True)
class RecordedTimeline:
    """Steps of a recording: `steps[j]` holds times relative to `starts[j]`, the start of
    training step `step_ids[j]` on the common clock; all times in the steps' `time_unit`."""

    steps: tuple[Timeline, ...]
    starts: tuple[float, ...]
    step_ids: tuple[int, ...]
    name: str = ""
    step_times: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not self.steps or not len(self.steps) == len(self.starts) == len(self.step_ids):
            raise TimelineError(
                "a recorded timeline needs one start and one step index per step, and at least one step"
            )
        if self.step_times is not None and len(self.step_times) != len(self.steps):
            raise TimelineError(f"step_times: {len(self.step_times)} times for {len(self.steps)} steps")

    @property
    def measured(self) -> StepTimes:
        """Each step's time: `step_times` as recorded, or without them each step's span from its
        start to its last op's end (basis `OP_SPAN`)."""
        if self.step_times is not None:
            return StepTimes(self.step_ids, self.step_times, self.time_unit)
        return StepTimes(self.step_ids, tuple(step.step_time for step in self.steps), self.time_unit, OP_SPAN)

    @property
    def time_unit(self) -> str:
        return self.steps[0].time_unit

    @property
    def num_ranks(self) -> int:
        return self.steps[0].num_ranks


def timeline_to_dict(
    timelines: Sequence[Timeline], starts: Sequence[float] | None = None, name: str = ""
) -> dict[str, Any]:
    """The v2 object for steps `timelines` (each with times from its own start); `starts[j]` is
    step j's start on the common clock (default: the steps laid end to end from 0)."""
    if not timelines:
        raise TimelineError("nothing to save: no steps")
    if starts is None:
        starts = [sum(t.step_time for t in timelines[:j]) for j in range(len(timelines))]
    if len(starts) != len(timelines):
        raise TimelineError(f"{len(starts)} step starts for {len(timelines)} steps")
    ranks: list[list[dict[str, Any]]] = [[] for _ in range(max(t.num_ranks for t in timelines))]
    for step, (timeline, offset) in enumerate(zip(timelines, starts)):
        for rank, intervals in enumerate(timeline.ranks):
            ranks[rank].extend(
                {"op": str(iv.op), "start": offset + iv.start, "end": offset + iv.end, "step": step} for iv in intervals
            )
    data: dict[str, Any] = {"schema": SCHEMA, "time_unit": timelines[0].time_unit}
    if name:
        data["name"] = name
    data["step_starts"] = [float(s) for s in starts]
    data["ranks"] = ranks
    return data


def save_timeline(
    timelines: Sequence[Timeline], path: str | Path, starts: Sequence[float] | None = None, name: str = ""
) -> None:
    """Write `timeline_to_dict(timelines, starts, name)` as JSON."""
    write_text_atomically(path, json.dumps(timeline_to_dict(timelines, starts, name)) + "\n")


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TimelineError(f"{where}: {value!r} is not a finite number")
    return float(value)


def _entry(data: Any, where: str) -> tuple[int, Op, float, float]:
    if not isinstance(data, dict):
        raise TimelineError(f"{where}: expected an object with op, start, end")
    unknown = sorted(set(data) - {"op", "start", "end", "step"})
    if unknown:
        raise TimelineError(f"{where}: unknown field {unknown[0]!r}; known fields are end, op, start, step")
    for key in ("op", "start", "end"):
        if key not in data:
            raise TimelineError(f"{where}.{key}: missing")
    if not isinstance(data["op"], str):
        raise TimelineError(f"{where}.op: expected an op string such as '1F3', got {data['op']!r}")
    try:
        op = Op.parse(data["op"])
    except ScheduleError as exc:
        raise TimelineError(f"{where}.op: {exc}") from None
    start, end = _number(data["start"], f"{where}.start"), _number(data["end"], f"{where}.end")
    if end < start:
        raise TimelineError(f"{where}: end {end} is before start {start}")
    step = data.get("step", 0)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise TimelineError(f"{where}.step: {step!r} is not a non-negative integer")
    return step, op, start, end


def timeline_from_dict(data: Any) -> RecordedTimeline:
    """Parse and check a v2 (or v1) object; every error names the field (e.g. ``ranks[1][4].end``)."""
    if not isinstance(data, dict):
        raise TimelineError("expected a JSON object with schema, time_unit, ranks")
    unknown = sorted(set(data) - {"schema", "name", "time_unit", "step_starts", "step_times", "ranks"})
    if unknown:
        raise TimelineError(
            f"unknown field {unknown[0]!r}; known fields are name, ranks, schema, step_starts, step_times, time_unit"
        )
    if data.get("schema") not in (SCHEMA, SCHEMA_V1):
        raise TimelineError(f"schema: {data.get('schema')!r} is not {SCHEMA!r} or {SCHEMA_V1!r}")
    unit = data.get("time_unit")
    if unit not in TIME_UNITS:
        raise TimelineError(f"time_unit: {unit!r} is not one of {', '.join(TIME_UNITS)}")
    ranks = data.get("ranks")
    if not isinstance(ranks, list) or not ranks or not all(isinstance(r, list) for r in ranks):
        raise TimelineError("ranks: expected a non-empty list with one list of ops per rank")
    entries = [[_entry(e, f"ranks[{r}][{i}]") for i, e in enumerate(ops)] for r, ops in enumerate(ranks)]
    step_ids = sorted({step for ops in entries for step, *_ in ops}) or [0]
    starts = _step_starts(data.get("step_starts"), entries, step_ids)
    steps = []
    for step, origin in zip(step_ids, starts):
        per_rank = [
            tuple(
                sorted(
                    (Interval(op, start - origin, end - origin) for s, op, start, end in ops if s == step),
                    key=lambda iv: (iv.start, iv.end),
                )
            )
            for ops in entries
        ]
        steps.append(Timeline(ranks=tuple(per_rank), time_unit=unit))
    name = data.get("name", "")
    if not isinstance(name, str):
        raise TimelineError(f"name: expected a string, got {name!r}")
    return RecordedTimeline(
        steps=tuple(steps),
        starts=tuple(starts),
        step_ids=tuple(step_ids),
        name=name,
        step_times=_step_times(data.get("step_times"), len(step_ids)),
    )


def _step_times(given: Any, num_steps: int) -> tuple[float, ...] | None:
    if given is None:
        return None
    if not isinstance(given, list) or len(given) != num_steps:
        raise TimelineError(f"step_times: expected a list of {num_steps} numbers, one per step")
    times = tuple(_number(v, f"step_times[{j}]") for j, v in enumerate(given))
    negative = next((j for j, t in enumerate(times) if t < 0), None)
    if negative is not None:
        raise TimelineError(f"step_times[{negative}]: {times[negative]} is negative")
    return times


def _step_starts(given: Any, entries: list[list[tuple[int, Op, float, float]]], step_ids: list[int]) -> list[float]:
    if given is None:
        earliest = {step: math.inf for step in step_ids}
        for ops in entries:
            for step, _, start, _ in ops:
                earliest[step] = min(earliest[step], start)
        return [earliest[step] if math.isfinite(earliest[step]) else 0.0 for step in step_ids]
    if not isinstance(given, list) or len(given) != len(step_ids):
        raise TimelineError(f"step_starts: expected a list of {len(step_ids)} numbers, one per step")
    starts = [_number(v, f"step_starts[{j}]") for j, v in enumerate(given)]
    start_of = dict(zip(step_ids, starts))
    for ops in entries:
        for step, op, start, _ in ops:
            if start < start_of[step] - 1e-9 * max(1.0, abs(start)):
                raise TimelineError(f"op {op} of step {step} starts at {start}, before its step_starts entry")
    return starts


def load_timeline(path: str | Path) -> RecordedTimeline:
    """Read a `pipefisher.timeline/v2` (or v1) file (JSON; YAML unless the suffix is .json)."""
    return load_structured(path, "timeline", timeline_from_dict, TimelineError, schema=SCHEMA)
