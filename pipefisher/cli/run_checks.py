"""What `pipefisher run` and `profile` check of a run before any process starts: the files its run
file names, its outputs, a plan given to it; and the one-line warnings for settings without effect.
UsageError (exit 2, one line) for what cannot run."""

from __future__ import annotations

import argparse

from pipefisher.cli.args import UsageError, check_input, check_output, say
from pipefisher.cli.metric_sinks import missing_package
from pipefisher.config import RunConfig
from pipefisher.core.ir import Schedule, ScheduleError
from pipefisher.methods.registry import methods, task_rules


def check_run_outputs(config: RunConfig) -> None:
    """The metrics file, the TensorBoard, checkpoint and trace folders can be written, and the
    packages of the metric sinks asked for are installed."""
    if config.run.metrics:
        check_output(config.run.metrics, "run.metrics (--metrics)")
    if config.run.tensorboard:
        check_output(config.run.tensorboard, "run.tensorboard", folder=True)
    problem = missing_package(config)
    if problem:
        raise UsageError(problem)
    if config.checkpoint.dir:
        check_output(config.checkpoint.dir, "checkpoint.dir (--checkpoint-dir)", folder=True)
    if config.run.trace:
        check_output(config.run.trace, "run.trace (--trace)", folder=True)
        last = config.run.trace_from + config.run.trace_steps - 1
        if last > config.run.steps:
            raise UsageError(
                f"run.trace_from {config.run.trace_from} + run.trace_steps {config.run.trace_steps}: the trace would end at step "
                f"{last}, after the run's last step {config.run.steps}; lower them or raise --steps"
            )


def warn_without_effect(args: argparse.Namespace, config: RunConfig) -> None:
    """One line for each flag the run's optimizer does not read: --profile on a first-order run,
    a method's flags (--kfac-*, --kfac.KEY, ...) with another optimizer; and for run.compile with
    --reference. (A run file's method sections are silent: a file carries several for --optimizer.)"""
    if args.reference and config.run.compile:
        say(
            "warning: run.compile has no effect with --reference: the reference trains eager, as the check of compiled runs"
        )
    if args.profile is not None and config.curvature is None:
        say(
            f"warning: --profile has no effect on a first-order run (optimizer {config.optimizer.name}); "
            f"it serves the packer of --optimizer {' or '.join(methods())}"
        )
    for section in methods():
        given = [dest for dest, value in vars(args).items() if value is not None]
        named = [flag for flag in given if flag.startswith(f"{section}_")] + [
            dest[len("key:") :] for dest in given if dest.startswith(f"key:{section}.")
        ]
        if named and config.optimizer.name != section:
            flags = ", ".join("--" + (flag if "." in flag else flag.replace("_", "-")) for flag in named)
            say(
                f"warning: {flags} {'has' if len(named) == 1 else 'have'} no effect with optimizer {config.optimizer.name}; "
                f"{'it applies' if len(named) == 1 else 'they apply'} to --optimizer {section}"
            )


def warn_if_emulated(config: RunConfig) -> None:
    """fp16 on CPUs is emulated: say so before the user waits for it."""
    from pipefisher.runtime.training.launch import resolve_backend

    if config.run.precision == "fp16" and resolve_backend(config.run.backend) == "gloo":
        say("warning: fp16 on a CPU is emulated, about 10x slower than fp32 here; bf16 or fp32 train at full speed")


def check_input_files(config: RunConfig) -> None:
    """Every file the run file names for the model and data exists, is a file, and (but for the
    safetensors weights) is text; UsageError naming the key otherwise."""
    named = {
        "data.corpus": "" if config.data.corpus == "embedded" else config.data.corpus,
        "data.vocab": config.data.vocab,
        "data.tokenizer": config.data.tokenizer,
        "model.config_json": config.model.config_json,
        "model.hf_weights": config.model.hf_weights,
    }
    for key, value in named.items():
        if value:
            check_input(value, key, text=key != "model.hf_weights")


def check_plan(config: RunConfig, schedule: Schedule, reference: bool) -> None:
    """The run's plan file fits it (method, schedule, shape, layers, layout), before any process
    starts; nothing to check for a run without a curvature method's section."""
    from pipefisher.planning.plan import Plan
    from pipefisher.runtime.training.pipefisher_run import check_plan_matches

    if config.curvature is None:
        return
    path = config.curvature.plan
    if reference:
        raise UsageError(
            f"--plan {path}: --reference trains in one process, without a plan; drop --plan "
            f"(and pin --{config.optimizer.name}-refresh-steps K)"
        )
    try:
        check_plan_matches(Plan.load(path, task_rules), config, schedule)
    except ScheduleError as exc:
        message = str(exc)
        raise UsageError(message if message.startswith(path) else f"{path}: {message}") from None
