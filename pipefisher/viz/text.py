"""Terminal Gantt chart: per panel a title and one row per rank, one character per time slice.

Rank rows are exactly `width` characters; every other line fits in `width`. Panels share one
time scale, so stacked schedules compare directly. A slice shows the op that covers its centre;
an op too short to cover any centre takes the slice under its midpoint if that slice is idle.
Zero-length ops (asynchronous sync / exchange launches) are not drawn; a rank's end of step
(gradient all-reduce, optimizer) shows as STEP_END. A weight gradient (W, zero-bubble schedules)
shows as WEIGHT[variant % 2], a letter that no forward or backward uses.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence

from pipefisher.viz.layout import CATEGORY_NAMES, Box, Panel

#: Narrowest width the chart can be drawn in (rank label plus a few slices).
MIN_WIDTH = 24

IDLE = "."
STEP_END = "~"
_FORWARD = ("0123456789", ")!@#$%^&*(")
_BACKWARD = ("abcdefghij", "ABCDEFGHIJ")
#: weight gradient of any micro-batch (pipe 0 / even chunks, pipe 1 / odd chunks)
WEIGHT = ("w", "W")
_CURVATURE = {
    "curvature-0": "+",
    "curvature-1": "*",
    "refresh-0": "<",
    "refresh-1": ">",
    "precondition": "=",
    "fold": ":",
    "sync": "|",
}


def box_char(box: Box) -> str:
    """Forward: digit of the micro-batch (mod 10); backward: its letter (a = 0); weight gradient:
    ``w``; pipe 1 or odd chunks: the shifted digit / capital letter / ``W``; a curvature method's ops: one
    symbol per kind and part."""
    if box.category == "forward":
        return _FORWARD[box.variant % 2][(box.op.micro_batch or 0) % 10]
    if box.category == "backward":
        return _BACKWARD[box.variant % 2][(box.op.micro_batch or 0) % 10]
    if box.category == "weight":
        return WEIGHT[box.variant % 2]
    return _CURVATURE[box.category]


def render_text(panels: Sequence[Panel], width: int) -> str:
    """The chart of `panels` stacked on one time axis, `width` (>= MIN_WIDTH) columns wide."""
    if width < MIN_WIDTH:
        raise ValueError(f"width {width} is below {MIN_WIDTH}")
    digits = len(str(max(p.num_ranks for p in panels) - 1))
    prefix = 7 + digits  # "rank 12 |"
    cells = width - prefix - 1
    span = max(p.end for p in panels) or 1.0
    slice_time = span / cells
    lines: list[str] = []
    for index, panel in enumerate(panels):
        if index:
            lines.append("")
        lines += _wrap(panel.title.split("; "), width)
        if len(panel.step_ids) > 1:
            lines.append(_step_line(panel, prefix, cells, slice_time))
        for rank, row in enumerate(_paint(panel, cells, slice_time)):
            lines.append(f"rank {rank:>{digits}} |{row}|")
    lines += _axis(span, panels[0].time_unit, prefix, cells, slice_time)
    lines += _wrap(_legend(panels), width)
    return "\n".join(lines) + "\n"


def _paint(panel: Panel, cells: int, slice_time: float) -> list[str]:
    """Rows of `cells` characters: ops, IDLE inside the panel's time span, blank after it."""
    idle_cells = min(cells, math.ceil(panel.end / slice_time - 0.5))
    rows = [[IDLE] * idle_cells + [" "] * (cells - idle_cells) for _ in range(panel.num_ranks)]
    for end in panel.step_ends:
        first, stop = _cells(end.start, end.end, cells, slice_time)
        rows[end.rank][first:stop] = STEP_END * max(0, stop - first)
    short: list[Box] = []
    for box in panel.boxes:
        if box.end <= box.start:
            continue
        first, stop = _cells(box.start, box.end, cells, slice_time)
        if first < stop:
            rows[box.rank][first:stop] = box_char(box) * (stop - first)
        else:
            short.append(box)
    for box in short:
        cell = min(cells - 1, int((box.start + box.end) / 2 / slice_time))
        if rows[box.rank][cell] in (IDLE, " "):
            rows[box.rank][cell] = box_char(box)
    return ["".join(row) for row in rows]


def _cells(start: float, end: float, cells: int, slice_time: float) -> tuple[int, int]:
    """[first, stop) of the slices whose centres lie in [start, end)."""
    return max(0, math.ceil(start / slice_time - 0.5)), min(cells, math.ceil(end / slice_time - 0.5))


def _step_line(panel: Panel, prefix: int, cells: int, slice_time: float) -> str:
    """`step` and, at each step's first slice, a bar and the step index."""
    line = [" "] * cells
    for start, step in zip(panel.step_starts, panel.step_ids):
        col = min(cells - 1, round(start / slice_time))
        text = (f"|{step}" if col else str(step))[: cells - col]
        if all(c == " " for c in line[max(0, col - 1) : col + len(text)]):
            line[col : col + len(text)] = text
    return ("step".ljust(prefix) + "".join(line)).rstrip()


def _nice_step(span: float, ticks: int) -> float:
    raw = span / max(1, ticks)
    magnitude = 10 ** math.floor(math.log10(raw))
    return next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw * (1 - 1e-9))


def _axis(span: float, unit: str, prefix: int, cells: int, slice_time: float) -> list[str]:
    """A tick line and a label line under the rows; the unit sits left of the labels."""
    step = _nice_step(span, max(1, cells // 10))
    decimals = max(0, -math.floor(math.log10(step)))
    ticks = [k * step for k in range(int(span / step * (1 + 1e-9)) + 1)]
    marks = ["-"] * cells
    labels = [" "] * cells
    free_from = 0
    for tick in ticks:
        col = min(cells - 1, round(tick / slice_time))
        marks[col] = "+"
        text = f"{tick:.{decimals}f}"
        if col >= free_from and col + len(text) <= cells:
            labels[col : col + len(text)] = text
            free_from = col + len(text) + 1
    unit_text = f"[{unit}]"[: prefix - 1].rjust(prefix - 1) + " "
    return [" " * prefix + "".join(marks), (unit_text + "".join(labels)).rstrip()]


def _wrap(parts: list[str], width: int) -> list[str]:
    """Lines of at most `width` holding `parts` joined by "; ", breaking inside a part only when
    it is longer than a line."""
    lines: list[str] = []
    for part in parts:
        if lines and len(lines[-1]) + 2 + len(part) <= width:
            lines[-1] += "; " + part
        else:
            lines += textwrap.wrap(part, width=width)
    return lines


def _legend(panels: Sequence[Panel]) -> list[str]:
    categories = {c for p in panels for c in p.categories}
    parts = [
        f"{_FORWARD[0][0]}-{_FORWARD[0][-1]} forward of micro-batch k (k mod 10), {_BACKWARD[0][0]}-{_BACKWARD[0][-1]} its backward"
    ]
    if "weight" in categories:
        parts[0] += f" (input gradient where W is split off), {WEIGHT[0]} weight gradient W of any micro-batch"
    if any(box.variant % 2 for p in panels for box in p.boxes if box.op.kind.is_compute):
        odd = f"{_FORWARD[1]} and {_BACKWARD[1][0]}-{_BACKWARD[1][-1]}" + (
            f" and {WEIGHT[1]}" if "weight" in categories else ""
        )
        parts.append(f"{odd} the same for pipe 1 (Chimera) or odd chunks (interleaved, V-shape)")
    names = {c: name for p in reversed(panels) for c, name in p.category_names.items()}
    names["sync"] += " (zero-length launches are not drawn)"
    parts += [f"{_CURVATURE[c]} {names[c]}" for c in CATEGORY_NAMES if c in _CURVATURE and c in categories]
    if any(p.step_ends for p in panels):
        parts.append(f"{STEP_END} end of step (all-reduce, optimizer)")
    parts.append(f"{IDLE} bubble")
    return parts
