"""The `pipefisher` command line. Usage errors exit 2 with one line on stderr, no traceback."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence

from pipefisher.core.table import format_table
from pipefisher.core.usage import USAGE_ERROR
from pipefisher.cli.args import (
    MAX_PACKED_SLOTS,
    ArgumentParser,
    UsageError,
    add_pipeline_arguments,
    add_tensor_parallel_argument,
    build_pipeline,
    check_output,
    positive_int,
    say,
)
from pipefisher.cli.checkpoint_command import add_checkpoint_parser
from pipefisher.cli.config_command import add_config_parser
from pipefisher.cli.data_command import add_data_parser
from pipefisher.cli.plan_command import add_plan_parser
from pipefisher.cli.run_command import add_profile_parser, add_run_parser
from pipefisher.cli.run_file_args import (
    add_placement_arguments,
    placement_section,
)
from pipefisher.config import ConfigError
from pipefisher.core.ir import ScheduleError, peak_activations, peak_pending_weights, splits_backward
from pipefisher.core.profile import ProfileError
from pipefisher.methods.registry import method_of_profile
from pipefisher.planning.tasks import stage_replicas
from pipefisher.planning.planner.model_sizes import PlanError
from pipefisher.planning.packing.pack import STRATEGIES, PackOptions
from pipefisher.planning.planner.pack_cache import PACKINGS
from pipefisher.planning.packing.text import format_pack_report
from pipefisher.planning.simulate import Timeline, simulate
from pipefisher.runtime.training.checkpoint_lock import FolderInUse


def _simulate_summary(schedule, timeline: Timeline) -> dict:
    devices = []
    for rank in range(schedule.num_ranks):
        busy = timeline.busy_time(rank)
        devices.append(
            {
                "rank": rank,
                "stages": [
                    f"p{pipe}.s{stage}" if schedule.num_pipes > 1 else f"s{stage}"
                    for pipe, stage in schedule.stages_of(rank)
                ],
                "busy_time": busy,
                "bubble_time": timeline.bubble_time(rank),
                "bubble_fraction": timeline.bubble_time(rank) / timeline.step_time if timeline.step_time else 0.0,
                "bubbles": len(timeline.bubbles(rank)),
                "peak_activations": peak_activations(schedule.ranks[rank]),
                "peak_pending_weights": peak_pending_weights(schedule.ranks[rank]),
            }
        )
    return {
        "schedule": schedule.name,
        "stages": schedule.num_ranks,
        "micro_batches": schedule.num_micro_batches,
        **({"chunks": schedule.params["chunks"]} if "chunks" in schedule.params else {}),
        "time_unit": timeline.time_unit,
        "step_time": timeline.step_time,
        "bubble_fraction": timeline.bubble_fraction,
        "devices": devices,
    }


def _cmd_simulate(args: argparse.Namespace) -> int:
    schedule, profile = build_pipeline(args)
    timeline = simulate(schedule, profile)
    summary = _simulate_summary(schedule, timeline)
    if args.json:
        print(json.dumps(summary))
        return 0
    unit = summary["time_unit"]
    chunks = f", {summary['chunks']} chunks" if "chunks" in summary else ""
    print(
        f"{schedule.name}: D={schedule.num_ranks}, N={schedule.num_micro_batches}{chunks}; "
        f"step time {timeline.step_time:.4g} {unit}, bubble {100 * timeline.bubble_fraction:.1f} % of device time"
    )
    headers = ["rank", "stages", f"busy [{unit}]", f"bubble [{unit}]", "bubble [%]", "gaps", "peak act [mb]"]
    rows = [
        [
            d["rank"],
            ",".join(d["stages"]),
            f"{d['busy_time']:.4g}",
            f"{d['bubble_time']:.4g}",
            f"{100 * d['bubble_fraction']:.1f}",
            d["bubbles"],
            d["peak_activations"],
        ]
        for d in summary["devices"]
    ]
    if any(map(splits_backward, schedule.ranks)):
        headers.append("pending W [mb]")
        for row, device in zip(rows, summary["devices"]):
            row.append(device["peak_pending_weights"])
    print(format_table(headers, rows))
    return 0


def _add_simulate(subparsers) -> None:
    parser = subparsers.add_parser("simulate", help="timeline of one step: step time, busy and bubble time per device")
    add_pipeline_arguments(parser)
    parser.add_argument("--profile", help="profile file (YAML or JSON, pipefisher.profile/v2); default: unit times")
    add_tensor_parallel_argument(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.set_defaults(handler=_cmd_simulate)


def _cmd_pack(args: argparse.Namespace) -> int:
    if args.output:
        check_output(args.output, "-o")
    schedule, profile = build_pipeline(args, profile_required=True, limit=MAX_PACKED_SLOTS, what="packing")
    if not any(stage.layers for stage in profile.stages):
        raise UsageError(f"{args.profile}: no stage lists layers of a curvature method; add `layers` to the stages")
    timed = method_of_profile(profile)  # the plan names it, also where the profile does not
    section = placement_section(args)
    # P ops where the method's run would have them on this layout (no ZeRO: the plan is the same)
    replicas = max(len(pipes) for pipes in stage_replicas(schedule).values()) * args.data_parallel
    options = PackOptions.from_section(
        section,
        data_parallel=args.data_parallel,
        strategy=args.strategy,
        precondition=timed.settings(helpers=section.helpers).precondition_op(replicas, 0),
    )
    # the packing `plan` and `run` share (`plan_layout`); without a run file the profile is packed as it is
    result = PACKINGS.packed(schedule, dataclasses.replace(profile, method=timed.name), options)
    if args.output:
        result.plan.save(args.output)
    if args.json:
        print(json.dumps(result.to_dict()))
        return 0
    print(format_pack_report(result))
    if args.output:
        print(f"plan written to {args.output} ({result.refresh_steps} steps per cycle)")
    return 0


def _add_pack(subparsers) -> None:
    parser = subparsers.add_parser(
        "pack", help="place a curvature method's work into the bubbles; report the refresh interval"
    )
    add_pipeline_arguments(parser)
    parser.add_argument(
        "--profile", required=True, help="profile file with the layers of a curvature method (pipefisher.profile/v2)"
    )
    add_tensor_parallel_argument(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("-o", "--output", help="write the plan (pipefisher.plan/v2 JSON) here")
    add_placement_arguments(parser)
    parser.add_argument(
        "--strategy", choices=STRATEGIES, default="fill", help="placement rule (published = PipeFisher's)"
    )
    parser.add_argument(
        "--data-parallel",
        type=positive_int,
        default=1,
        help="copies of the pipeline: factors are synced over them too (default 1)",
    )
    parser.set_defaults(handler=_cmd_pack)


def _cmd_export(args: argparse.Namespace) -> int:
    from pipefisher.config import load_config

    config = load_config(args.config).with_overrides(checkpoint={"dir": args.checkpoint_dir})
    if not config.checkpoint.dir:
        raise UsageError("export needs the run's checkpoints: give --checkpoint-dir or set checkpoint.dir")
    check_output(args.output, "-o", folder=True)
    from pipefisher.runtime.training.checkpoint import CheckpointError
    from pipefisher.runtime.training.export import export_checkpoint

    try:
        exported = export_checkpoint(config, args.output)
    except CheckpointError as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        raise UsageError(f"cannot write {args.output}: {exc.strerror or exc}") from None
    say(
        f"wrote {exported.folder}: {exported.model_class} at step {exported.step}, "
        f"{exported.parameters / 1e6:.2f} M parameters, {exported.weights_bytes / 2**20:.1f} MiB of weights"
    )
    return 0


def _add_export(subparsers) -> None:
    parser = subparsers.add_parser("export", help="write a Hugging Face model's checkpoint as a from_pretrained folder")
    parser.add_argument("config", help="the run's YAML run file (model.kind hf)")
    parser.add_argument(
        "-o", "--output", required=True, help="folder to write (config.json, model.safetensors, tokenizer.json)"
    )
    parser.add_argument(
        "--checkpoint-dir", help="the run's checkpoints (checkpoint.dir); the newest that verifies is exported"
    )
    parser.set_defaults(handler=_cmd_export)


def _version() -> str:
    """The installed distribution's version ("unknown" when run from a checkout never installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pipefisher")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="pipefisher",
        description="Plan and run pipeline-parallel training with second-order optimizer work in the bubbles.",
    )
    parser.add_argument("--version", action="version", version=f"pipefisher {_version()}")
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
    _add_simulate(subparsers)
    _add_pack(subparsers)
    add_run_parser(subparsers)
    add_profile_parser(subparsers)
    _add_export(subparsers)
    add_config_parser(subparsers)
    add_plan_parser(subparsers)
    add_checkpoint_parser(subparsers)
    add_data_parser(subparsers)
    from pipefisher.cli.viz_command import add_viz_parser

    add_viz_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The exit code: 0, 1 for a failed run, 2 for bad input, 128 + the signal that stopped it."""
    from pipefisher.runtime.console import show_runtime_messages
    from pipefisher.cli.scripts import interruption_exit
    from pipefisher.runtime.training.stopping import Terminated, raise_on_sigterm

    if threading.current_thread() is threading.main_thread():
        raise_on_sigterm()
    show_runtime_messages()
    try:
        args = build_parser().parse_args(argv)
        handler: Callable[[argparse.Namespace], int] = args.handler
        return handler(args)
    except (UsageError, ScheduleError, ProfileError, ConfigError, PlanError, FolderInUse) as exc:
        print(f"pipefisher: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return USAGE_ERROR
    except (KeyboardInterrupt, Terminated) as exc:  # before (or without) a run's own handlers: planning, preparing data
        return interruption_exit(exc, "pipefisher")
    except BrokenPipeError:  # the reader of stdout left (`| head`): stop quietly, as a shell tool does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush finds no pipe
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
