"""The recorded-timeline format `pipefisher.timeline/v1`: what ran on every rank, and when.

A file holds one JSON object::

    {"schema": "pipefisher.timeline/v1", "name": "tiny-cpu 1f1b", "time_unit": "ms",
     "step_starts": [0.0, 11.3],
     "ranks": [[{"op": "0F0", "start": 0.0, "end": 1.2, "step": 0}, ...], ...]}

`ranks[r]` lists rank r's ops (string form of `pipefisher.core.ir.Op`) with start/end on one clock
shared by all ranks (any origin, in `time_unit`: s, ms, us or units). `step` (optional, default
0) is the training step an op belongs to; `step_starts` (optional) gives each step's start, in
the order of the sorted step indices, and defaults to the earliest start among the step's ops.
`name` is optional. The profiler writes this format; `pipefisher viz --timeline` draws it.
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

SCHEMA = "pipefisher.timeline/v1"


class TimelineError(ProfileError):
    """A recorded timeline is malformed (a ProfileError, so the CLI reports it in one line)."""


@dataclass(frozen=True)
class RecordedTimeline:
    """Steps of a recording: `steps[j]` holds times relative to `starts[j]`, the start of
    training step `step_ids[j]` on the common clock; all times in the steps' `time_unit`."""

    steps: tuple[Timeline, ...]
    starts: tuple[float, ...]
    step_ids: tuple[int, ...]
    name: str = ""

    def __post_init__(self) -> None:
        if not self.steps or not len(self.steps) == len(self.starts) == len(self.step_ids):
            raise TimelineError("a recorded timeline needs one start and one step index per step, and at least one step")

    @property
    def time_unit(self) -> str:
        return self.steps[0].time_unit

    @property
    def num_ranks(self) -> int:
        return self.steps[0].num_ranks


def timeline_to_dict(timelines: Sequence[Timeline], starts: Sequence[float] | None = None, name: str = "") -> dict[str, Any]:
    """The v1 object for steps `timelines` (each with times from its own start); `starts[j]` is
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


def save_timeline(timelines: Sequence[Timeline], path: str | Path, starts: Sequence[float] | None = None, name: str = "") -> None:
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
    """Parse and check a v1 object; every error names the field (e.g. ``ranks[1][4].end``)."""
    if not isinstance(data, dict):
        raise TimelineError("expected a JSON object with schema, time_unit, ranks")
    unknown = sorted(set(data) - {"schema", "name", "time_unit", "step_starts", "ranks"})
    if unknown:
        raise TimelineError(f"unknown field {unknown[0]!r}; known fields are name, ranks, schema, step_starts, time_unit")
    if data.get("schema") != SCHEMA:
        raise TimelineError(f"schema: {data.get('schema')!r} is not {SCHEMA!r}")
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
            tuple(sorted((Interval(op, start - origin, end - origin) for s, op, start, end in ops if s == step), key=lambda iv: (iv.start, iv.end)))
            for ops in entries
        ]
        steps.append(Timeline(ranks=tuple(per_rank), time_unit=unit))
    name = data.get("name", "")
    if not isinstance(name, str):
        raise TimelineError(f"name: expected a string, got {name!r}")
    return RecordedTimeline(steps=tuple(steps), starts=tuple(starts), step_ids=tuple(step_ids), name=name)


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
    """Read a `pipefisher.timeline/v1` file (JSON; YAML unless the suffix is .json)."""
    return load_structured(path, "timeline", timeline_from_dict, TimelineError, schema=SCHEMA)
