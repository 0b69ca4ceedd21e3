"""`pipefisher run` and `pipefisher profile`: their flags, the checks before any process starts
(the run file, its outputs, the checkpoint folder's one writer, the resumed step), then the
launch."""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import AbstractContextManager, nullcontext

from pipefisher.cli.args import UsageError, check_output, positive_float, positive_int, say
from pipefisher.cli.run_checks import (
    check_input_files,
    check_plan,
    check_run_outputs,
    warn_if_emulated,
    warn_without_effect,
)
from pipefisher.cli.run_file_args import (
    add_key_arguments,
    add_method_arguments,
    load_run,
    method_overrides,
    optimizer_names,
)
from pipefisher.core.names import BACKENDS, PRECISIONS
from pipefisher.core.profile import ProfileError, load_profile
from pipefisher.methods.registry import DEFAULT_METHOD, method_of, methods
from pipefisher.runtime.training.checkpoint_lock import hold_checkpoint_folder
from pipefisher.schedules import SCHEDULES


def _cmd_run(args: argparse.Namespace) -> int:
    config = load_run(args).with_overrides(
        pipeline={
            "schedule": args.schedule,
            "data_parallel": args.data_parallel,
            "tensor_parallel": args.tensor_parallel,
        },
        optimizer={"name": args.optimizer, "zero": args.zero},
        **method_overrides(args),
        checkpoint={"dir": args.checkpoint_dir, "resume": "always" if args.resume else None},
        comm={"powersgd_rank": args.powersgd_rank},
        run={
            "steps": args.steps,
            "time_budget_s": args.time_budget,
            "backend": args.backend,
            "master_port": args.master_port,
            "timeout": args.timeout,
            "metrics": args.metrics,
            "precision": args.precision,
            "in_order": args.in_order or None,
            "trace": args.trace,
        },
    )
    check_run_outputs(config)
    method = method_of(config).name
    warn_without_effect(args, config)
    config = config.with_overrides(**{method: {"profile": args.profile, "plan": args.plan}})
    warn_if_emulated(config)
    if args.reference and config.run.trace:
        raise UsageError(
            "--reference trains in one process without the executor whose actions a trace labels; "
            "drop --trace (run.trace) or --reference"
        )
    if args.reference and config.comm.powersgd_rank:
        raise UsageError(
            "--reference trains in one process, without a gradient reduction to compress; "
            "drop --powersgd-rank (comm.powersgd_rank) or --reference"
        )
    from pipefisher.runtime.training.assembly import build_schedule

    schedule = build_schedule(config)  # an impossible schedule is a usage error, before any process starts
    model = _prepare_model(config)
    section = config.curvature
    if section is not None and section.profile:
        from pipefisher.runtime.training.run_profile import run_profile

        profile = load_profile(section.profile)  # names the file in its own errors
        try:
            run_profile(profile, config, schedule.num_stages, model)
        except ProfileError as exc:
            raise UsageError(f"{section.profile}: {exc}") from None
    if section is not None and section.plan:
        check_plan(config, schedule, args.reference)
    elif args.plan:
        raise UsageError(
            f"--plan {args.plan}: a plan places a curvature method's work; this run's optimizer is "
            f"{config.optimizer.name} (use --optimizer {' or '.join(methods())})"
        )
    if args.reference and section is not None and section.refresh_steps < 1:
        raise UsageError(f"--reference with {method} needs --{method}-refresh-steps K (the reference has no packer)")
    from pipefisher.cli.training import check_port, run

    problem = None if args.reference else check_port(config)
    if problem:
        raise UsageError(problem)
    with _checkpoint_writer(config, args.reference):
        resume_from = None if args.reference else _resume_step(config)
        if resume_from is not None and resume_from >= config.run.steps:
            say(f"the checkpoint is at step {resume_from}; nothing to do for --steps {config.run.steps}")
            return 0
        return run(config, reference=args.reference, as_json=args.json, resume_from=resume_from)


def _checkpoint_writer(config, reference: bool) -> AbstractContextManager:
    """The lock that makes this run checkpoint.dir's one writer, for the run's life
    (`pipefisher.runtime.training.checkpoint_lock`; FolderInUse when another run holds it). None
    is taken without a folder, for --reference (it writes no checkpoints), and under torchrun on
    every process but 0 (process 0 holds it for the group)."""
    if not config.checkpoint.dir or reference or os.environ.get("RANK", "0") != "0":
        return nullcontext()
    return hold_checkpoint_folder(config.checkpoint.dir)


def _resume_step(config) -> int | None:
    """The verified checkpoint step to continue from (checkpoint.resume), or None to start at 0;
    says which newer checkpoints were skipped and why."""
    if config.checkpoint.resume == "never":
        return None
    from pipefisher.runtime.training.checkpoint import CheckpointError, has_checkpoints
    from pipefisher.runtime.training.resumption import resumable_step, resumption

    if config.checkpoint.resume == "auto" and not has_checkpoints(config.checkpoint.dir):
        return None  # nothing saved yet: a first start
    try:
        step, skipped = resumable_step(config.checkpoint.dir, config, writer=True)  # this run holds the folder
        how = resumption(config.checkpoint.dir, step, config)
    except CheckpointError as exc:
        raise UsageError(str(exc)) from None
    for line in skipped:
        say(f"checkpoint {line}")
    say(how.summary(fell_back=bool(skipped)))
    return step


def _cmd_profile(args: argparse.Namespace) -> int:
    config = load_run(args).with_overrides(
        pipeline={
            "schedule": args.schedule,
            "data_parallel": args.data_parallel,
            "tensor_parallel": args.tensor_parallel,
        },
        optimizer={"name": args.optimizer, "zero": args.zero},
        comm={"powersgd_rank": args.powersgd_rank},
        run={"master_port": args.master_port, "backend": args.backend, "precision": args.precision},
    )
    from pipefisher.cli.training import check_port, profile_run
    from pipefisher.runtime.training.assembly import build_schedule

    check_output(args.output, "-o")
    if args.timeline:
        check_output(args.timeline, "--timeline")
    build_schedule(config)
    _prepare_model(config)
    problem = check_port(config)
    if problem:
        raise UsageError(problem)
    return profile_run(config, args.output, args.timeline, args.repeats)


def _prepare_model(config):
    """Check that the model splits into the run's stages; for text data this also builds (and
    caches on disk) the tokenizer and tokens once, before the ranks start and read the cache. The model."""
    from pipefisher.runtime.training.assembly import staged_model

    check_input_files(config)

    def announce() -> None:
        message = (
            f"pipefisher: reading the token shards of {config.data.shards} (memory-mapped)"
            if config.data.kind == "shards"
            else f"pipefisher: preparing the {config.data.kind} data (tokenizer and tokens are cached)"
        )
        print(message, file=sys.stderr, flush=True)

    return staged_model(config, on_data=announce)


def add_profile_parser(subparsers) -> None:
    """`pipefisher profile RUNFILE -o PROFILE`."""
    parser = subparsers.add_parser("profile", help="measure a profile of a run on this machine")
    parser.add_argument("config", help="YAML run file")
    parser.add_argument("-o", "--output", required=True, help="profile to write (YAML, or JSON by suffix)")
    parser.add_argument("--timeline", help="also write the measured per-rank timeline (pipefisher.timeline/v1 JSON)")
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), help="override pipeline.schedule")
    parser.add_argument("--repeats", type=positive_int, default=5, help="measured steps (default 5, medians)")
    parser.add_argument("--data-parallel", type=positive_int, help="replicas of the pipeline (pipeline.data_parallel)")
    parser.add_argument(
        "--tensor-parallel",
        type=positive_int,
        metavar="T",
        help="processes each block is split over (pipeline.tensor_parallel)",
    )
    _add_gradient_path_arguments(parser)
    parser.add_argument("--precision", choices=PRECISIONS, help="override run.precision")
    parser.add_argument("--backend", choices=BACKENDS, help="override run.backend")
    parser.add_argument("--master-port", type=int, help="override run.master_port (0 picks a free port)")
    parser.add_argument(
        "--optimizer",
        choices=optimizer_names(),
        help=f"override optimizer.name: the tasks of its curvature method are timed (of {DEFAULT_METHOD} for a first-order optimizer)",
    )
    add_key_arguments(parser)
    parser.set_defaults(handler=_cmd_profile)


def _add_gradient_path_arguments(parser) -> None:
    """--zero and --powersgd-rank: how the data-parallel gradient travels (run and profile)."""
    parser.add_argument(
        "--zero",
        type=int,
        choices=[0, 1, 2, 3],
        help="ZeRO stage over each stage's replicas: 1 shards the optimizer state, 2 also the gradients, "
        "3 also the parameters (FSDP2) (optimizer.zero)",
    )
    parser.add_argument(
        "--powersgd-rank",
        type=int,
        metavar="R",
        help="compress each stage's gradient reduction with rank-R PowerSGD; 0 = off (comm.powersgd_rank)",
    )


def add_run_parser(subparsers) -> None:
    """`pipefisher run RUNFILE`."""
    parser = subparsers.add_parser("run", help="train from a run file (local processes, torchrun, or --reference)")
    parser.add_argument("config", help="YAML run file, e.g. schedules/tiny-cpu.yaml")
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), help="override pipeline.schedule")
    parser.add_argument("--steps", type=positive_int, help="total steps of the run (run.steps)")
    parser.add_argument(
        "--time-budget",
        type=positive_float,
        metavar="SECONDS",
        help="end the run after the step that passes this many seconds of training (run.time_budget_s)",
    )
    parser.add_argument("--optimizer", choices=optimizer_names(), help="override optimizer.name")
    add_method_arguments(parser)
    parser.add_argument("--profile", help="profile of this run for the packer (<method>.profile); default: measure one")
    parser.add_argument(
        "--plan",
        help="run this plan of `pipefisher pack -o` instead of packing (<method>.plan); checked against the run first",
    )
    parser.add_argument("--data-parallel", type=positive_int, help="replicas of the pipeline (pipeline.data_parallel)")
    parser.add_argument(
        "--tensor-parallel",
        type=positive_int,
        metavar="T",
        help="processes each block is split over (pipeline.tensor_parallel)",
    )
    _add_gradient_path_arguments(parser)
    parser.add_argument(
        "--precision", choices=PRECISIONS, help="fp32, or bf16/fp16 autocast with fp32 master weights (run.precision)"
    )
    parser.add_argument(
        "--in-order",
        action="store_true",
        help="hold every process group to NCCL's in-order rule (run.in_order; a test mode for gloo)",
    )
    parser.add_argument("--backend", choices=BACKENDS, help="override run.backend")
    parser.add_argument("--master-port", type=int, help="override run.master_port (0 picks a free port)")
    parser.add_argument("--timeout", type=float, help="seconds a rank may wait for another (run.timeout)")
    parser.add_argument("--checkpoint-dir", help="write checkpoints here (checkpoint.dir)")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint that verifies, up to --steps (checkpoint.resume always)",
    )
    parser.add_argument("--metrics", help="append one JSON line per step to this file (run.metrics)")
    parser.add_argument(
        "--trace",
        metavar="DIR",
        help="write a PyTorch profiler trace per rank of steps run.trace_from.. "
        "(default 3 and 4), every action labelled (run.trace)",
    )
    parser.add_argument("--reference", action="store_true", help="the same training in one process, without pipelining")
    parser.add_argument("--json", action="store_true", help="one JSON object per step on stdout")
    add_key_arguments(parser)
    parser.set_defaults(handler=_cmd_run)
