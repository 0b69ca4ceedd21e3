"""`pipefisher viz`: draw schedules, curvature packings or recorded timelines.

Input: a run file (its pipeline section), or --schedule/--stages/--micro-batches (flags override
the run file), or --compare S1,S2,... (each S a schedule name, ``S+M`` for S with PipeFisher's
curvature packing; see `pipefisher.viz.compare`), or --timeline FILE (`pipefisher.timeline/v2`).
Output by the suffix of -o: .svg/.png (figure), .json (Chrome / Perfetto trace), .txt or - (text
chart); --max-steps K draws only the first K steps of multi-step panels. --compare also prints a
table per entry (bubble, k, step time, overhead), or with --json one JSON object. Without
--profile every schedule runs on unit times (forward 1, backward 2 per stage, split evenly over a
device's chunks: `pipefisher simulate`'s rule), which have no curvature layers, so ``S+M`` needs
--profile FILE; --compare's D defaults to the profile's stage count (4 without one), N to 2·D.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

from pipefisher.core.files import write_text_atomically
from pipefisher.cli.args import (
    MAX_PACKED_SLOTS,
    MAX_SIMULATED_SLOTS,
    UsageError,
    add_pipeline_arguments,
    build_pipeline,
    check_output,
    check_planning_size,
    positive_int,
)
from pipefisher.methods.registry import method_of_profile
from pipefisher.viz.compare import Compared, Setup, compare, compare_to_dict, format_compare_table
from pipefisher.viz.compare import parse_entries as parse_compare
from pipefisher.viz.layout import Panel, curvature_panel, first_steps, recorded_panel, schedule_panel
from pipefisher.viz.text import MIN_WIDTH

#: --compare's D without -D, a run file or a profile file
DEFAULT_COMPARE_STAGES = 4
#: how to make a profile with curvature layers (the GPipe example of docs/cli.md), for the S+M error
PROFILE_EXAMPLE = (
    "python -m pipefisher.cli.bert_profile profiles/reference/bert-base_time_memory_p100.csv "
    "-D 4 --micro-batch-size 32 -o /tmp/bert-base-4.yaml"
)
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
        help="draw a schedule, its curvature packing or a recorded timeline (SVG, PNG, Chrome trace, text)",
        description=__doc__,
    )
    parser.add_argument("config", nargs="?", help="YAML run file: pipeline.schedule/stages/micro_batches/chunks")
    add_pipeline_arguments(cast(argparse.ArgumentParser, _NotRequired(parser)))
    parser.add_argument(
        "--compare",
        metavar="S1,S2,...",
        help="stack schedules on one time axis and print a table of bubble, k, step time and overhead; S+M = S with the profile's tasks of curvature method M packed into its bubbles",
    )
    parser.add_argument(
        "--profile",
        help="profile file (pipefisher.profile/v2); default: unit times (forward 1, backward 2 per stage), no curvature layers",
    )
    parser.add_argument("--json", action="store_true", help="--compare: print the table as one JSON object")
    parser.add_argument(
        "--curvature",
        action="store_true",
        help="pack the profile's curvature tasks into the bubbles and draw the whole refresh cycle (needs --profile with layers)",
    )
    parser.add_argument("--timeline", metavar="FILE", help="draw a recorded timeline (pipefisher.timeline/v2 JSON)")
    parser.add_argument(
        "--trace",
        metavar="DIR",
        help="draw the steps a `pipefisher run --trace DIR` traced; with a run file or "
        "--schedule, below the simulator's prediction from the trace's own op times "
        "(or --profile's)",
    )
    parser.add_argument(
        "--actions",
        action="store_true",
        help="--trace: draw every action of the first traced step (receives, "
        "sends, waits, collectives, end of step too) instead; .png or .svg",
    )
    parser.add_argument(
        "-o", "--output", required=True, help="OUT.svg, OUT.png, OUT.json (Chrome/Perfetto trace), OUT.txt or - (text)"
    )
    parser.add_argument(
        "--max-steps",
        type=positive_int,
        metavar="K",
        help="draw only the first K steps of a refresh cycle or recording (default: all); titles and tables keep the whole",
    )
    parser.add_argument(
        "--width", type=int, help=f"text width in columns (default: the terminal's; at least {MIN_WIDTH})"
    )
    parser.set_defaults(handler=run_viz)


def run_viz(args: argparse.Namespace) -> int:
    """Handler of `pipefisher viz`; returns the exit code (0)."""
    kind = output_kind(args.output)
    if kind != "-":
        check_output(args.output, "-o")
    width = args.width if args.width is not None else shutil.get_terminal_size().columns
    if kind in (".txt", "-") and width < MIN_WIDTH:
        raise UsageError(f"--width {width}: the text chart needs at least {MIN_WIDTH} columns")
    if args.json and (args.compare is None or kind == "-"):
        raise UsageError(
            "--json prints --compare's table; use it with --compare and -o FILE"
            if kind == "-"
            else "--json applies to --compare"
        )
    if args.actions:
        return _draw_actions(args, kind)
    compared = None
    if args.compare is not None and args.timeline is None and args.trace is None:
        compared, setup = compare_entries(args)
        panels = [row.panel for row in compared]
    else:
        panels = build_panels(args)
    if args.max_steps is not None:
        panels = [first_steps(panel, args.max_steps) for panel in panels]
    if kind == "-":
        from pipefisher.viz.text import render_text

        sys.stdout.write(render_text(panels, width))
    else:
        try:
            write_output(panels, Path(args.output), kind, width)
        except OSError as exc:
            raise UsageError(f"cannot write {args.output}: {exc.strerror or exc}") from None
        if not args.json:
            print(f"{args.output}: {', '.join(p.name for p in panels)} ({sum(len(p.boxes) for p in panels)} ops)")
    if compared is not None:
        if args.json:
            print(json.dumps(compare_to_dict(compared, setup)))
        else:
            print(("\n" if kind == "-" else "") + str(setup))
            print(format_compare_table(compared))
    if args.trace is not None:
        from pipefisher.viz.trace_io import load_trace, trace_files
        from pipefisher.viz.trace_summary import format_summary, method_attribution, summarise

        measured = panels[-1].step_times  # `_trace_panels` puts the recording last
        assert measured is not None
        shares = method_attribution(load_trace(args.trace))
        print(("\n" if kind == "-" else "") + format_summary(summarise(trace_files(args.trace)), measured, shares))
    return 0


def output_kind(output: str) -> str:
    """The output type of `-o`: its suffix (.svg, .png, .json, .txt) or '-' for stdout."""
    kind = output if output == "-" else Path(output).suffix.lower()
    if kind not in OUTPUTS:
        raise UsageError(
            f"-o {output}: unknown output type; use a .svg, .png, .json or .txt file, or - for the terminal"
        )
    return kind


def write_output(panels: list[Panel], path: Path, kind: str, width: int) -> None:
    if kind == ".json":
        from pipefisher.viz.chrome import write_chrome_trace

        write_chrome_trace(panels, path)
    elif kind == ".txt":
        from pipefisher.viz.text import render_text

        write_text_atomically(path, render_text(panels, width))
    else:
        from pipefisher.viz.figure import render_figure

        render_figure(panels, path)


def build_panels(args: argparse.Namespace) -> list[Panel]:
    """The panels of a single schedule (run file or --schedule) or a --timeline; bad
    combinations raise UsageError. --compare goes through `compare_entries`."""
    if args.timeline is not None:
        return [_timeline_panel(args)]
    if args.trace is not None:
        return _trace_panels(args)
    config = _run_file(args)
    if args.schedule is None and config is None:
        raise UsageError("nothing to draw: give a run file, --schedule S, --compare S1,S2 or --timeline FILE")
    name = args.schedule or config.schedule
    stages = args.stages or (config.stages if config else None)
    micro_batches = args.micro_batches or (config.micro_batches if config else None)
    if stages is None or micro_batches is None:
        raise UsageError("--stages and --micro-batches are required without a run file")
    if args.chunks is not None and name != "interleaved":
        raise UsageError("--chunks applies to the interleaved schedule only")
    chunks = args.chunks or (config.chunks if config else None)
    pipeline = argparse.Namespace(
        schedule=name,
        stages=stages,
        micro_batches=micro_batches,
        profile=args.profile,
        chunks=chunks if name == "interleaved" else None,
    )
    if args.curvature and args.profile is None:
        raise UsageError(
            f"{name} --curvature: needs --profile FILE with a curvature method's layers; the default unit profile has none"
        )
    schedule, profile = build_pipeline(
        pipeline,
        limit=MAX_PACKED_SLOTS if args.curvature else MAX_SIMULATED_SLOTS,
        what="packing" if args.curvature else "simulating",
    )
    return [
        curvature_panel(schedule, profile, method_of_profile(profile).rules)
        if args.curvature
        else schedule_panel(schedule, profile)
    ]


def compare_entries(args: argparse.Namespace) -> tuple[list[Compared], Setup]:
    """The --compare rows and their setup: D and N from the flags, the run file, or the defaults
    of the module docstring."""
    if args.schedule is not None:
        raise UsageError("give --schedule or --compare, not both")
    if args.curvature:
        raise UsageError(
            "--curvature applies to --schedule; in --compare write S+M for each schedule S to pack with method M"
        )
    entries = parse_compare(args.compare)
    config = _run_file(args)
    stages = args.stages or (config.stages if config else None)
    micro_batches = args.micro_batches or (config.micro_batches if config else None)
    if args.chunks is not None and all(entry.schedule != "interleaved" for entry in entries):
        raise UsageError("--chunks applies to the interleaved schedule only")
    chunks = args.chunks or (config.chunks if config else None)
    if args.profile is not None:
        from pipefisher.core.profile import load_profile

        profile = load_profile(args.profile)
        stages = stages or profile.num_stages
        about = args.profile
    else:
        packed = next((entry for entry in entries if entry.packed), None)
        if packed is not None:
            raise UsageError(
                f"{packed}: needs --profile FILE with a curvature method's layers; the default unit times have none "
                f"(make one with e.g. {PROFILE_EXAMPLE})"
            )
        from pipefisher.core.profile import uniform_profile

        # D stages of forward 1, backward 2; `compare` cuts them per chunk as `simulate` does
        stages = stages or DEFAULT_COMPARE_STAGES
        profile = uniform_profile(stages)
        about = "unit times (forward 1, backward 2 per stage)"
    micro_batches = micro_batches or 2 * stages
    for entry in entries:
        limit, what = (MAX_PACKED_SLOTS, "packing") if entry.packed else (MAX_SIMULATED_SLOTS, "simulating")
        check_planning_size(
            entry.schedule, stages, micro_batches, chunks if entry.schedule == "interleaved" else None, limit, what
        )
    return compare(entries, stages, micro_batches, profile, chunks), Setup(stages, micro_batches, about)


def _run_file(args: argparse.Namespace):
    """The run file's pipeline section, or None without a run file."""
    if args.config is None:
        return None
    from pipefisher.config import load_config

    return load_config(args.config).pipeline


def _timeline_panel(args: argparse.Namespace) -> Panel:
    given = {
        "a run file": args.config,
        "--schedule": args.schedule,
        "--compare": args.compare,
        "--stages": args.stages,
        "--micro-batches": args.micro_batches,
        "--chunks": args.chunks,
        "--profile": args.profile,
        "--curvature": args.curvature or None,
        "--json": args.json or None,
    }
    clash = next((flag for flag, value in given.items() if value is not None), None)
    if clash is not None:
        raise UsageError(f"--timeline draws a recorded timeline as it is; drop {clash}")
    from pipefisher.planning.timeline_file import load_timeline

    record = load_timeline(args.timeline)
    return recorded_panel(record, record.name or Path(args.timeline).name)


def _trace_panels(args: argparse.Namespace) -> list[Panel]:
    """The traced steps; with a schedule (run file or --schedule), the simulated step first, on
    --profile's times or the trace's median op times per stage."""
    from pipefisher.viz.trace_io import load_trace, trace_profile

    clash = next(
        (
            flag
            for flag, value in {
                "--timeline": args.timeline,
                "--compare": args.compare,
                "--curvature": args.curvature or None,
                "--json": args.json or None,
            }.items()
            if value is not None
        ),
        None,
    )
    if clash is not None:
        raise UsageError(f"--trace draws a traced run beside its schedule's prediction; drop {clash}")
    measured = load_trace(args.trace)
    config = _run_file(args)
    name = args.schedule or (config.schedule if config else None)
    if name is None:
        return [recorded_panel(measured, measured.name)]
    stages = args.stages or (config.stages if config else measured.num_ranks)
    micro_batches = args.micro_batches or (config.micro_batches if config else None)
    if micro_batches is None:
        raise UsageError("--trace with --schedule: give --micro-batches (or a run file)")
    chunks = args.chunks or (config.chunks if config else None)
    pipeline = argparse.Namespace(
        schedule=name,
        stages=stages,
        micro_batches=micro_batches,
        profile=args.profile,
        chunks=chunks if name == "interleaved" else None,
    )
    schedule, profile = build_pipeline(pipeline)
    if args.profile is None:
        profile = trace_profile(measured, schedule.num_stages)
    predicted = schedule_panel(schedule, profile)
    return [
        replace(predicted, name=f"{predicted.name} predicted ({'--profile' if args.profile else 'trace op times'})"),
        recorded_panel(measured, measured.name),
    ]


def _draw_actions(args: argparse.Namespace, kind: str) -> int:
    """--trace DIR --actions -o OUT.png|svg: the first traced step, every action labelled."""
    if args.trace is None:
        raise UsageError("--actions draws a trace's actions; give --trace DIR (from `pipefisher run --trace DIR`)")
    if kind not in (".png", ".svg"):
        raise UsageError(f"--actions draws a figure; give -o OUT.png or OUT.svg, not {args.output}")
    from pipefisher.viz.action_figure import render_actions
    from pipefisher.viz.trace_io import trace_files

    render_actions(trace_files(args.trace), Path(args.output))
    print(f"{args.output}: every action of the first traced step of {args.trace}")
    return 0
