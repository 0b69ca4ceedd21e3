"""Chrome / Perfetto trace (JSON object format) of panels: one process per panel, one track per rank.

Every box becomes a complete event (``ph: "X"``) named by its op string, with ts/dur in
microseconds (abstract "units" are written as milliseconds) and args kind, stage,
micro_batch, pipe, layer, step; a rank's end of step (gradient all-reduce, optimizer) is a
complete event named ``step end`` (cat ``step_end``). Step starts are instant events
(``ph: "i"``, cat ``step``); metadata events name processes and tracks. Load the file in ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipefisher.core.files import write_text_atomically
from pipefisher.viz.layout import Panel

#: Microseconds per time unit of a profile or recording.
MICROSECONDS = {"s": 1e6, "ms": 1e3, "us": 1.0, "units": 1e3}


def chrome_trace(panels: Sequence[Panel]) -> dict[str, Any]:
    """The trace object: `traceEvents` plus `otherData` (the source time unit and its scale)."""
    events: list[dict[str, Any]] = []
    for pid, panel in enumerate(panels):
        scale = MICROSECONDS[panel.time_unit]
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": panel.title}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
        for rank in range(panel.num_ranks):
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": rank, "args": {"name": f"rank {rank}"}})
            events.append(
                {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": rank, "args": {"sort_index": rank}}
            )
        for start, step in zip(panel.step_starts, panel.step_ids):
            events.append(
                {"name": f"step {step}", "cat": "step", "ph": "i", "s": "p", "ts": start * scale, "pid": pid, "tid": 0}
            )
        for box in panel.boxes:
            op = box.op
            args: dict[str, Any] = {"kind": op.kind.name, "stage": op.stage, "pipe": op.pipe, "step": box.step}
            if op.micro_batch is not None:
                args["micro_batch"] = op.micro_batch
            if op.layer is not None:
                args["layer"] = op.layer
            if op.part is not None:
                args["part"] = op.part
            events.append(
                {
                    "name": str(op),
                    "cat": box.category,
                    "ph": "X",
                    "ts": box.start * scale,
                    "dur": (box.end - box.start) * scale,
                    "pid": pid,
                    "tid": box.rank,
                    "args": args,
                }
            )
        for end in panel.step_ends:
            events.append(
                {
                    "name": "step end",
                    "cat": "step_end",
                    "ph": "X",
                    "ts": end.start * scale,
                    "dur": end.duration * scale,
                    "pid": pid,
                    "tid": end.rank,
                }
            )
    unit = panels[0].time_unit
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"time_unit": unit, "microseconds_per_unit": MICROSECONDS[unit]},
    }


def write_chrome_trace(panels: Sequence[Panel], path: str | Path) -> None:
    write_text_atomically(path, json.dumps(chrome_trace(panels)) + "\n")
