"""Matplotlib picture of panels, stacked on one time axis: SVG or PNG by the file suffix.

Per panel one row per rank (rank 0 on top), boxes coloured by category (lighter shades for
pipe 1 / later chunks), idle time in light grey, dashed lines at step starts, the panel title
above it, one legend for the figure. In the SVG every op is one ``<path>`` inside the group
``ops<panel>-<category>`` (zero-length launches: ``ops<panel>-<category>-launch``), every
bubble one inside ``bubbles<panel>``, every end of step one inside ``step-ends<panel>``; box labels have ids ``label<panel>-<n>`` and are drawn only
where they fit inside their box.
matplotlib is imported here, lazily, with the Agg canvas; pyplot is not used.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from pipefisher.core.files import write_atomically
from pipefisher.viz.layout import CATEGORY_NAMES, Box, Panel

COLOURS = {
    "forward": "#4a7bc4",
    "backward": "#3a9a5c",
    "weight": "#17a2b8",
    "curvature-0": "#f2a33a",
    "curvature-1": "#e0603a",
    "sync": "#222222",
    "refresh-0": "#8a66c2",
    "refresh-1": "#c4559c",
    "precondition": "#9a7a50",
    "fold": "#c9a66b",
}
BUBBLE_COLOUR = "#e6e6e6"
STEP_END_COLOUR = "#8c8c8c"
FORMATS = (".svg", ".png")

_WIDTH = 12.0  # figure width, inches
_LEFT, _RIGHT = 0.75, 0.2  # margins, inches
_TITLE, _AXIS, _TOP = 0.42, 0.55, 0.08  # inches above each panel, for the time axis, above all
_LEGEND_ROW, _LEGEND_COLUMNS = 0.22, 6
_FONT = 6.5  # box label size, points
_BOX = 0.42  # half height of a box, in rows


def _row_height(num_ranks: int) -> float:
    """Inches per rank: roomy for a few ranks, compact for many."""
    return min(0.32, max(0.14, 5.0 / num_ranks))


def _shade(colour: str, variant: int) -> tuple[float, float, float]:
    """`colour` mixed with white, more for higher variants (cycling through three shades)."""
    from matplotlib.colors import to_rgb

    mix = 0.3 * (variant % 3)
    return tuple(c + (1 - c) * mix for c in to_rgb(colour))  # type: ignore[return-value]


def _dark(rgb: tuple[float, float, float]) -> bool:
    return 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2] < 0.55


def render_figure(panels: Sequence[Panel], path: str | Path) -> None:
    """Draw `panels` to `path` (.svg or .png)."""
    from matplotlib import rc_context
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    if path.suffix not in FORMATS:
        raise ValueError(f"{path}: the figure is written as {' or '.join(FORMATS)}")
    heights = [p.num_ranks * _row_height(p.num_ranks) + 0.1 for p in panels]
    entries = _legend_entries(panels)
    columns = min(len(entries), _LEGEND_COLUMNS)
    note_height = 0.2 if _has_variants(panels) else 0.0
    total = (
        _TOP + sum(h + _TITLE for h in heights) + _AXIS + _LEGEND_ROW * math.ceil(len(entries) / columns) + note_height
    )
    span = max(p.end for p in panels) or 1.0
    with rc_context({"svg.fonttype": "none", "svg.hashsalt": "pipefisher", "font.size": 8}):
        fig = Figure(figsize=(_WIDTH, total))
        FigureCanvasAgg(fig)
        width = _WIDTH - _LEFT - _RIGHT
        top = total - _TOP
        axes = []
        for index, (panel, height) in enumerate(zip(panels, heights)):
            top -= _TITLE + height
            ax = fig.add_axes((_LEFT / _WIDTH, top / total, width / _WIDTH, height / total))
            _draw_panel(ax, panel, index, span, width * 72, _row_height(panel.num_ranks) * 72)
            axes.append(ax)
        for ax in axes[:-1]:
            ax.tick_params(labelbottom=False)
        axes[-1].set_xlabel(f"time [{panels[-1].time_unit}]")
        _legend(fig, entries, columns, note_height)
        write_atomically(
            path,
            lambda temporary: fig.savefig(
                temporary, dpi=110, metadata={"Date": None} if path.suffix == ".svg" else None
            ),
        )


def _draw_panel(ax, panel: Panel, index: int, span: float, axes_points: float, row_points: float) -> None:
    """Panel number `index` into `ax`, whose x axis spans [0, span] over `axes_points` points."""
    from matplotlib.collections import LineCollection, PolyCollection

    def rect(start: float, end: float, rank: int) -> list[tuple[float, float]]:
        return [(start, rank - _BOX), (end, rank - _BOX), (end, rank + _BOX), (start, rank + _BOX)]

    points_per_unit = axes_points / span
    bubbles = PolyCollection(
        [rect(b.start, b.end, b.rank) for b in panel.bubbles], facecolors=BUBBLE_COLOUR, edgecolors="none"
    )
    bubbles.set_gid(f"bubbles{index}")
    ax.add_collection(bubbles)
    step_ends = PolyCollection(
        [rect(e.start, e.end, e.rank) for e in panel.step_ends], facecolors=STEP_END_COLOUR, edgecolors="none"
    )
    step_ends.set_gid(f"step-ends{index}")
    ax.add_collection(step_ends)
    by_category: dict[str, list[Box]] = {}
    for box in panel.boxes:
        by_category.setdefault(box.category, []).append(box)
    for category, boxes in by_category.items():
        wide = [b for b in boxes if b.end > b.start]
        launches = [b for b in boxes if b.end <= b.start]
        if wide:
            mean_points = sum(b.end - b.start for b in wide) / len(wide) * points_per_unit
            shapes = PolyCollection(
                [rect(b.start, b.end, b.rank) for b in wide],
                facecolors=[_shade(COLOURS[category], b.variant) for b in wide],
                edgecolors="white",
                linewidths=0.4 if mean_points > 4 else 0.0,
            )
            shapes.set_gid(f"ops{index}-{category}")
            ax.add_collection(shapes)
        if launches:
            marks = LineCollection(
                [[(b.start, b.rank - _BOX - 0.05), (b.start, b.rank + _BOX + 0.05)] for b in launches],
                colors=COLOURS[category],
                linewidths=0.9,
            )
            marks.set_gid(f"ops{index}-{category}-launch")
            ax.add_collection(marks)
    if row_points >= _FONT * 1.25:
        fitting = (b for b in panel.boxes if (b.end - b.start) * points_per_unit >= len(b.label) * _FONT * 0.62 + 2)
        for number, box in enumerate(fitting):
            colour = _shade(COLOURS[box.category], box.variant)
            ax.text(
                (box.start + box.end) / 2,
                box.rank,
                box.label,
                ha="center",
                va="center",
                fontsize=_FONT,
                color="white" if _dark(colour) else "black",
                clip_on=True,
                gid=f"label{index}-{number}",
            )
    multi_step = len(panel.step_ids) > 1
    for start, step in zip(panel.step_starts, panel.step_ids):
        if start > 0:
            ax.axvline(start, color="#444444", linestyle="--", linewidth=0.8)
        if multi_step:
            ax.text(start, -0.5, f" step {step}", ha="left", va="bottom", fontsize=7, color="#444444", clip_on=False)
    ax.set_xlim(0, span)
    ax.set_ylim(panel.num_ranks - 0.5, -0.5)
    every = math.ceil(panel.num_ranks / 16)
    ranks = range(0, panel.num_ranks, every)
    ax.set_yticks(list(ranks), [f"rank {r}" for r in ranks])
    ax.tick_params(axis="y", length=0)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_title(panel.title, loc="left", fontsize=8.5, pad=12 if multi_step else 4)


def _legend_entries(panels: Sequence[Panel]) -> list[tuple[str | tuple[float, float, float], str]]:
    """(colour, text) of the legend: categories present, the lighter shade if used, bubbles."""
    present = {c for p in panels for c in p.categories}
    names = {c: name for p in reversed(panels) for c, name in p.category_names.items()}
    entries: list[tuple[str | tuple[float, float, float], str]] = [
        (COLOURS[c], names.get(c, name)) for c, name in CATEGORY_NAMES.items() if c in present
    ]
    if _has_variants(panels):
        entries.append((_shade(COLOURS["forward"], 1), "lighter: pipe 1 / later chunk"))
    if any(p.step_ends for p in panels):
        entries.append((STEP_END_COLOUR, "end of step (all-reduce, optimizer)"))
    entries.append((BUBBLE_COLOUR, "bubble (idle)"))
    return entries


def _has_variants(panels: Sequence[Panel]) -> bool:
    return any(b.variant for p in panels for b in p.boxes)


def _legend(fig, entries: list, columns: int, note_height: float) -> None:
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=colour, label=text) for colour, text in entries]
    fig.legend(handles=handles, loc="lower center", ncol=columns, frameon=False, fontsize=8, bbox_to_anchor=(0.5, 0.0))
    if note_height:
        rows = math.ceil(len(entries) / columns)
        note = "box labels: micro-batch, prefixed p1: for pipe 1 (Chimera) or c1: for chunk 1 (interleaved, V-shape)"
        fig.text(
            0.5,
            (0.08 + _LEGEND_ROW * rows) / fig.get_figheight(),
            note,
            ha="center",
            va="bottom",
            fontsize=7,
            color="#444444",
        )
