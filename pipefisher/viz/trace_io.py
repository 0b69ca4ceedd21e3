"""Measured timelines from `pipefisher run --trace` (PyTorch profiler traces, Chrome format).

The executor labels every action it performs while a profiler is on: ``step N`` around a step,
the op's string form (``1F3``, ``0CA2:encoder.layer.1...``) around an op, ``recv:``/``send:``/
``w:``/``+`` around communication and ``step end`` around the end of step. Of those, the ops and
their steps (1-based, as the run counts them) make a `RecordedTimeline` (times in ms on the traces' shared clock: every rank of one
machine writes the same ``baseTimeNanoseconds``), and their median times per stage a `Profile`,
so the simulator can predict the same steps without the waits. Pure Python: no torch.

A traced step's time is the one `pipefisher run` printed for it: rank 0 reports, and its
executor writes its step timer's reading after the step (``step N time T ms``,
`pipefisher.core.trace_labels`). Rank 0's ``step N`` region spans the same interval on the
profiler's clock, but entering and leaving a region under the profiler costs tens of µs, enough to
change a last printed digit; traces without the marker have no step times (`step_durations`).
"""

from __future__ import annotations

import gzip
import json
import re
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipefisher.core.ir import Op, OpKind, ScheduleError
from pipefisher.core.profile import Profile, StageProfile
from pipefisher.core.trace_labels import STEP, STEP_TIME
from pipefisher.planning.timeline_file import SCHEMA, RecordedTimeline, TimelineError, timeline_from_dict

RANK_FILE = re.compile(r"rank(\d+)\.json(\.gz)?$")


def trace_files(path: str | Path) -> list[Path]:
    """A trace folder's `rank<R>.json` files in rank order (or the one file `path`)."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise TimelineError(f"{path}: no such trace folder or file (write one with `pipefisher run ... --trace DIR`)")
    found = sorted((int(m.group(1)), p) for p in path.iterdir() if (m := RANK_FILE.search(p.name)))
    if not found:
        raise TimelineError(f"{path}: holds no rank<R>.json trace (write one with `pipefisher run ... --trace DIR`)")
    ranks = [rank for rank, _ in found]
    if ranks != list(range(len(ranks))):
        raise TimelineError(f"{path}: traces of ranks {ranks}; expected rank0.json .. rank{len(ranks) - 1}.json")
    return [p for _, p in found]


def load_events(path: Path) -> list[dict[str, Any]]:
    """Every event of one Chrome-format trace (a `.json` or gzipped `.json.gz` file)."""
    try:
        text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
        data = json.loads(text)
    except (OSError, ValueError) as exc:
        raise TimelineError(f"{path}: not a readable JSON trace ({exc})") from None
    events = data.get("traceEvents") if isinstance(data, dict) else None
    if not isinstance(events, list):
        raise TimelineError(f"{path}: no traceEvents; expected a PyTorch profiler trace (Chrome format)")
    return [e for e in events if isinstance(e, dict)]


def labelled_events(path: Path) -> list[dict[str, Any]]:
    """The labelled regions (Chrome complete events of category user_annotation) of one trace."""
    return [e for e in load_events(path) if e.get("ph") == "X" and e.get("cat") == "user_annotation"]


def step_spans(events: Sequence[dict[str, Any]]) -> list[tuple[float, float, int]]:
    """(begin, end, N) of every ``step N`` region among one trace's `events` (µs), in time order."""
    return sorted(
        (e["ts"], e["ts"] + e["dur"], int(m.group(1)))
        for e in events
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and (m := STEP.match(e["name"]))
    )


def step_durations(events: Sequence[dict[str, Any]]) -> dict[int, float]:
    """Step N -> its time [ms] by the module's definition, from rank 0's labelled trace `events`;
    a step without a ``step N time T ms`` marker (a trace written before markers) is left out."""
    return {int(m.group(1)): float(m.group(2)) for e in events if (m := STEP_TIME.match(e["name"]))}


def trace_to_dict(paths: Sequence[Path], name: str = "") -> dict[str, Any]:
    """The `pipefisher.timeline/v1` object of the labelled ops in `paths` (one trace per rank, rank
    0 first); its `step_times` are the first trace's `step_durations` (the module's definition),
    left out when that trace lacks one of a step with ops."""
    ranks: list[list[dict[str, Any]]] = []
    starts: dict[int, float] = {}
    durations: dict[int, float] = {}
    for path in paths:
        events = labelled_events(path)
        steps = step_spans(events)
        if not steps:
            raise TimelineError(f"{path}: no 'step N' region; was it written by `pipefisher run --trace`?")
        for begin, _, step in steps:
            starts[step] = min(starts.get(step, begin), begin)
        if not ranks:  # the first trace: rank 0's
            durations = step_durations(events)
        entries = []
        for event in events:
            try:
                op = Op.parse(event["name"])
            except (ScheduleError, ValueError):
                continue
            start = event["ts"]
            in_step = next((s for begin, end, s in steps if begin <= start <= end), None)
            if in_step is not None:
                entries.append(
                    {"op": str(op), "start": start / 1e3, "end": (start + event["dur"]) / 1e3, "step": in_step}
                )
        ranks.append(sorted(entries, key=lambda e: e["start"]))
    traced = sorted({entry["step"] for entries in ranks for entry in entries})
    data: dict[str, Any] = {
        "schema": SCHEMA,
        "time_unit": "ms",
        "step_starts": [starts[step] / 1e3 for step in traced],
        "ranks": ranks,
    }
    if traced and all(step in durations for step in traced):
        data["step_times"] = [durations[step] for step in traced]
    if name:
        data["name"] = name
    return data


def load_trace(path: str | Path, name: str = "") -> RecordedTimeline:
    """The measured timeline of a trace folder (or one rank's trace file)."""
    return timeline_from_dict(trace_to_dict(trace_files(path), name or f"measured ({Path(path).name})"))


def trace_profile(record: RecordedTimeline, num_stages: int) -> Profile:
    """Median forward, backward and weight time [ms] of each of `num_stages` stages in `record`
    (backward includes the weight part when the trace splits it off, as `StageProfile` counts it)."""
    times: dict[tuple[int, OpKind], list[float]] = defaultdict(list)
    for step in record.steps:
        for intervals in step.ranks:
            for interval in intervals:
                times[(interval.op.stage, interval.op.kind)].append(interval.end - interval.start)

    def median(stage: int, kind: OpKind) -> float:
        return statistics.median(times[(stage, kind)]) if times[(stage, kind)] else 0.0

    missing = [stage for stage in range(num_stages) if not times[(stage, OpKind.FORWARD)]]
    if missing:
        raise TimelineError(f"the trace has no forward of stage {missing[0]}; is it a trace of this run's schedule?")
    stages = tuple(
        StageProfile(
            forward=median(s, OpKind.FORWARD),
            backward=median(s, OpKind.BACKWARD) + median(s, OpKind.WEIGHT),
            weight=median(s, OpKind.WEIGHT),
        )
        for s in range(num_stages)
    )
    return Profile(stages=stages, time_unit="ms", device="measured trace")
