"""`pipefisher viz`: draw schedules, curvature packings (K-FAC, Shampoo) or recorded timelines.

Input: a run file (its pipeline section), or --schedule/--stages/--micro-batches (flags override
the run file), or --compare S1,S2,... (each S a schedule name, ``S+kfac`` for S with PipeFisher's
curvature packing), or --timeline FILE (`pipefisher.timeline/v1`). Output by the suffix of -o:
.svg/.png (figure), .json (Chrome / Perfetto trace), .txt or - (text chart).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any, cast

from pipefisher.cli_args import UsageError, add_pipeline_arguments, build_pipeline
from pipefisher.schedules import SCHEDULES
from pipefisher.viz.layout import Panel, curvature_panel, recorded_panel, schedule_panel
from pipefisher.viz.text import MIN_WIDTH

KFAC_SUFFIX = "+kfac"
OUTPUTS = (".svg", ".png", ".json", ".txt", "-")


class _NotRequired:
    """Forwards `add_argument` with required=False: viz may take D, N and the schedule from a run file."""

    def __init__(self, parser: argparse.ArgumentParser):
        self._parser = parser

    def add_argument(self, *names: str, **options: Any) -> argparse.Action:
        return self._parser.add_argument(*names, **{**options, "required": False})


def add_viz_parser(subparsers: Any) -> None:
    """Register the `viz` subcommand on the `pipefisher` subparsers."""
    parser = subparsers.add_parser(
        "viz",
        help="draw a schedule, its K-FAC or Shampoo packing or a recorded timeline (SVG, PNG, Chrome trace, text)",
        description=__doc__,
    )
    parser.add_argument("config", nargs="?", help="YAML run file: pipeline.schedule/stages/micro_batches/chunks")
    add_pipeline_arguments(cast(argparse.ArgumentParser, _NotRequired(parser)))
    parser.add_argument("--compare", metavar="S1,S2,...", help=f"stack schedules on one time axis; S{KFAC_SUFFIX} = S with the profile's K-FAC or Shampoo tasks packed into its bubbles")
    parser.add_argument("--profile", help="profile file (pipefisher.profile/v1); default: unit times")
    parser.add_argument("--kfac", "--curvature", dest="kfac", action="store_true",
                        help="pack the profile's curvature tasks (K-FAC or Shampoo) into the bubbles and draw the whole refresh cycle (needs --profile with layers)")
    parser.add_argument("--timeline", metavar="FILE", help="draw a recorded timeline (pipefisher.timeline/v1 JSON)")
    parser.add_argument("-o", "--output", required=True, help="OUT.svg, OUT.png, OUT.json (Chrome/Perfetto trace), OUT.txt or - (text)")
    parser.add_argument("--width", type=int, help=f"text width in columns (default: the terminal's; at least {MIN_WIDTH})")
    parser.set_defaults(handler=run_viz)


def run_viz(args: argparse.Namespace) -> int:
    """Handler of `pipefisher viz`; returns the exit code (0)."""
    kind = output_kind(args.output)
    width = args.width if args.width is not None else shutil.get_terminal_size().columns
    if kind in (".txt", "-") and width < MIN_WIDTH:
        raise UsageError(f"--width {width}: the text chart needs at least {MIN_WIDTH} columns")
    panels = build_panels(args)
    if kind == "-":
        from pipefisher.viz.text import render_text

        sys.stdout.write(render_text(panels, width))
        return 0
    try:
        write_output(panels, Path(args.output), kind, width)
    except OSError as exc:
        raise UsageError(f"cannot write {args.output}: {exc.strerror or exc}") from None
    print(f"{args.output}: {', '.join(p.name for p in panels)} ({sum(len(p.boxes) for p in panels)} ops)")
    return 0


def output_kind(output: str) -> str:
    """The output type of `-o`: its suffix (.svg, .png, .json, .txt) or '-' for stdout."""
    kind = output if output == "-" else Path(output).suffix.lower()
    if kind not in OUTPUTS:
        raise UsageError(f"-o {output}: unknown output type; use a .svg, .png, .json or .txt file, or - for the terminal")
    return kind


def write_output(panels: list[Panel], path: Path, kind: str, width: int) -> None:
    if kind == ".json":
        from pipefisher.viz.chrome import write_chrome_trace

        write_chrome_trace(panels, path)
    elif kind == ".txt":
        from pipefisher.viz.text import render_text

        path.write_text(render_text(panels, width))
    else:
        from pipefisher.viz.figure import render_figure

        render_figure(panels, path)


def parse_compare(text: str) -> list[tuple[str, bool]]:
    """`gpipe,gpipe+kfac` -> [("gpipe", False), ("gpipe", True)]."""
    entries = []
    for item in (part.strip() for part in text.split(",")):
        name, kfac = (item[: -len(KFAC_SUFFIX)], True) if item.endswith(KFAC_SUFFIX) else (item, False)
        if name not in SCHEDULES:
            raise UsageError(
                f"--compare: {item!r} is not a schedule or schedule{KFAC_SUFFIX}; schedules: {', '.join(sorted(SCHEDULES))}"
            )
        entries.append((name, kfac))
    return entries


def build_panels(args: argparse.Namespace) -> list[Panel]:
    """The panels the arguments ask for (see the module docstring); bad combinations raise UsageError."""
    if args.timeline is not None:
        return [_timeline_panel(args)]
    config = None
    if args.config is not None:
        from pipefisher.config import load_config

        config = load_config(args.config).pipeline
    if args.compare is not None:
        if args.schedule is not None:
            raise UsageError("give --schedule or --compare, not both")
        if args.kfac:
            raise UsageError(f"--kfac applies to --schedule; in --compare write S{KFAC_SUFFIX} for each schedule to pack")
        entries = parse_compare(args.compare)
    elif args.schedule is not None or config is not None:
        entries = [(args.schedule or config.schedule, args.kfac)]
    else:
        raise UsageError("nothing to draw: give a run file, --schedule S, --compare S1,S2 or --timeline FILE")
    stages = args.stages or (config.stages if config else None)
    micro_batches = args.micro_batches or (config.micro_batches if config else None)
    if stages is None or micro_batches is None:
        raise UsageError("--stages and --micro-batches are required without a run file")
    if args.chunks is not None and all(name != "interleaved" for name, _ in entries):
        raise UsageError("--chunks applies to the interleaved schedule only")
    chunks = args.chunks or (config.chunks if config else None)
    panels = []
    for name, kfac in entries:
        pipeline = argparse.Namespace(
            schedule=name, stages=stages, micro_batches=micro_batches, profile=args.profile,
            chunks=chunks if name == "interleaved" else None,
        )
        if kfac and args.profile is None:
            raise UsageError(f"{name}{KFAC_SUFFIX if args.compare else ' --kfac'}: needs --profile FILE with K-FAC or Shampoo layers; the default unit profile has none")
        schedule, profile = build_pipeline(pipeline)
        panels.append(curvature_panel(schedule, profile) if kfac else schedule_panel(schedule, profile))
    return panels


def _timeline_panel(args: argparse.Namespace) -> Panel:
    given = {
        "a run file": args.config, "--schedule": args.schedule, "--compare": args.compare, "--stages": args.stages,
        "--micro-batches": args.micro_batches, "--chunks": args.chunks, "--profile": args.profile, "--kfac": args.kfac or None,
    }
    clash = next((flag for flag, value in given.items() if value is not None), None)
    if clash is not None:
        raise UsageError(f"--timeline draws a recorded timeline as it is; drop {clash}")
    from pipefisher.viz.timeline_io import load_timeline

    record = load_timeline(args.timeline)
    return recorded_panel(record, record.name or Path(args.timeline).name)
