"""Command-line pieces shared by `pipefisher` and its subcommands (`viz`, helper scripts):
the usage error, a one-line-error argument parser, argument types, the pipeline arguments and
the text table.
Pure Python: no torch.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from pipefisher.core.profile import load_profile, uniform_profile
from pipefisher.core.settings import closest
from pipefisher.core.usage import UsageError
from pipefisher.schedules import SCHEDULES, chunks_per_rank, get_schedule
from pipefisher.schedules.validate import validate

#: the most (rank, model chunk, micro-batch) triples per step a planning command takes: about 5 s
#: and 300 MB to simulate on 2 cores; packing holds every op of a whole refresh cycle, so it
#: takes 8x fewer (D = 24, N = 1536 packs in 7 s and 600 MB)
MAX_SIMULATED_SLOTS = 1 << 18
MAX_PACKED_SLOTS = 1 << 15


class ArgumentParser(argparse.ArgumentParser):
    """Reports a usage error as one line (UsageError) instead of argparse's usage block; takes
    long options only as written (no abbreviations: `--kfac.damp` is not `--kfac.damping`), and
    names the option an unrecognized one most likely meant."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:  # argparse prints usage on several lines; keep one
        raise UsageError(f"{message} (see {self.prog} --help)")

    def parse_args(  # type: ignore[override]  # one signature for argparse's overloads
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        """argparse's, but an unrecognized option is reported by the (sub)command that got it,
        with the closest option it has: "unrecognized argument --kfac.damp; did you mean --kfac.damping?"."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = _chosen_command(self, parsed)
            unknown = next((extra.split("=", 1)[0] for extra in extras if extra.startswith("--")), None)
            meant = _closest_option(unknown, list(parser._option_string_actions)) if unknown else None
            if meant:
                parser.error(f"unrecognized argument {unknown}; did you mean {meant}?")
            parser.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed


def _closest_option(unknown: str, options: list[str]) -> str | None:
    """The option a mistyped `unknown` most likely meant; `--SECTION.KEY` is compared by KEY
    against the keys of its own section (the shared `--SECTION.` would make any key look close)."""
    section, dot, key = unknown.rpartition(".")
    keys = {option[len(section) + 1 :]: option for option in options if dot and option.startswith(section + ".")}
    if keys:
        meant = closest(key, keys)
        return keys[meant] if meant else None
    return closest(unknown, options)


def _chosen_command(parser: argparse.ArgumentParser, parsed: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost (sub)command parser that `parsed` chose (`parser` itself without subcommands)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(getattr(parsed, action.dest, None) or "")
            if chosen is not None:
                return _chosen_command(chosen, parsed)
    return parser


def _checked(
    text: str,
    convert: Callable[[str], Any],
    noun: str,
    ok: Callable[[Any], bool],
    requirement: str,
    shown: Callable[[Any], str] = str,
) -> Any:
    """`convert(text)` if it parses and passes `ok`, else argparse's error naming the value."""
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"{shown(value)} {requirement}")
    return value


def whole(text: str) -> int:
    """An integer as people write it: 12, 1_000, or a whole number in float notation (1e3), as
    the run file takes it; ValueError otherwise."""
    try:
        return int(text)
    except ValueError:
        number = float(text)
        if not number.is_integer():
            raise
        return int(number)


def positive_int(text: str) -> int:
    """An integer >= 1 (argparse type), in any form `whole` takes."""
    return _checked(text, whole, "an integer", lambda v: v >= 1, "must be at least 1")


def positive_float(text: str) -> float:
    """A number > 0 (argparse type)."""
    return _checked(text, float, "a number", lambda v: v > 0, "must be > 0")


def non_negative_float(text: str) -> float:
    """A number >= 0 (argparse type)."""
    return _checked(text, float, "a number", lambda v: v >= 0, "must be >= 0")


def add_pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    """--schedule/--stages/--micro-batches/--chunks/--profile, shared by planning commands."""
    parser.add_argument("--schedule", required=True, choices=sorted(SCHEDULES), help="pipeline schedule")
    parser.add_argument("--stages", "-D", type=positive_int, required=True, help="pipeline depth D (ranks)")
    parser.add_argument("--micro-batches", "-N", type=positive_int, required=True, help="micro-batches per step N")
    parser.add_argument(
        "--chunks",
        type=positive_int,
        default=None,
        help="model chunks per rank (interleaved only; default 2; zbv and dualpipev hold 2)",
    )


def add_tensor_parallel_argument(parser: argparse.ArgumentParser) -> None:
    """--tensor-parallel T: the degree the command's profile must describe (`build_pipeline`)."""
    parser.add_argument(
        "--tensor-parallel",
        type=positive_int,
        default=1,
        metavar="T",
        help="tensor-parallel degree T: the --profile must describe one of T ranks (its tensor_parallel; "
        "python -m pipefisher.cli.bert_profile --tensor-parallel T makes one); default 1",
    )


def check_planning_size(
    schedule: str, stages: int, micro_batches: int, chunks: int | None, limit: int, what: str
) -> None:
    """UsageError when D x N (x the chunks per rank) exceeds `limit`, before anything is built."""
    per_rank = chunks_per_rank(schedule, chunks)
    slots = stages * micro_batches * per_rank
    if slots > limit:
        chunked = f" x {per_rank} chunks" if per_rank > 1 else ""
        raise UsageError(
            f"--stages {stages} x --micro-batches {micro_batches}{chunked} = {slots:,} slots per step: "
            f"{what} takes at most {limit:,} (seconds of work here); use fewer stages or micro-batches"
        )


def build_pipeline(
    args: argparse.Namespace, profile_required: bool = False, limit: int = MAX_SIMULATED_SLOTS, what: str = "simulating"
) -> tuple:
    """(schedule, profile) from the shared arguments; without a profile, unit times per rank.
    Refuses (UsageError) a pipeline of more than `limit` slots (`check_planning_size`) and, where
    the command takes --tensor-parallel T, a profile of another degree (unit times: only T = 1)."""
    check_planning_size(args.schedule, args.stages, args.micro_batches, args.chunks, limit, what)
    schedule = validate(get_schedule(args.schedule, args.stages, args.micro_batches, args.chunks))
    degree = getattr(args, "tensor_parallel", None)
    if args.profile is not None:
        profile = load_profile(args.profile)
        if degree is not None and profile.tensor_parallel != degree:
            raise UsageError(
                f"--tensor-parallel {degree}: {args.profile} describes tensor_parallel {profile.tensor_parallel}; "
                f"give --tensor-parallel {profile.tensor_parallel} or a profile made at degree {degree}"
            )
    elif profile_required:
        raise UsageError("--profile is required")
    elif degree not in (None, 1):
        raise UsageError(
            f"--tensor-parallel {degree}: unit times have no tensor-parallel model; give a --profile made at degree {degree} "
            f"(python -m pipefisher.cli.bert_profile CSV --tensor-parallel {degree})"
        )
    else:
        # Each rank's share of the model costs forward 1, backward 2, whatever the chunking.
        chunks = schedule.num_stages // schedule.num_ranks
        profile = uniform_profile(schedule.num_stages, forward=1.0 / chunks, backward=2.0 / chunks)
    return schedule, profile


def say(message: str) -> None:
    """One line on stderr (from rank 0 only under torchrun)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"pipefisher: {message}", file=sys.stderr, flush=True)


def check_input(path: str, key: str, text: bool = True) -> None:
    """UsageError naming `key` unless `path` is an existing file (of text, when `text`)."""
    target = Path(path)
    if not target.exists():
        raise UsageError(f"{key}: {path} does not exist")
    if target.is_dir():
        raise UsageError(f"{key}: {path} is a folder; give a file")
    try:
        with open(target, "rb") as handle:
            head = handle.read(4096)
    except OSError as exc:
        raise UsageError(f"{key}: cannot read {path}: {exc.strerror}") from None
    if text:
        try:
            head.decode("utf-8")
        except UnicodeDecodeError as exc:
            if exc.start < len(head) - 4:  # not a character cut at the end of the sample
                raise UsageError(f"{key}: {path} is not a text file") from None


def check_output(path: str, flag: str, folder: bool = False) -> None:
    """UsageError naming `flag` unless `path` can be written before any work starts: a file in an
    existing, writable folder that is not itself a folder; or (`folder`) a folder, existing or
    to be made, whose nearest existing ancestor is writable and which is not a file."""
    target = Path(path)
    if folder:
        if target.exists() and not target.is_dir():
            raise UsageError(f"{flag} {path}: is a file; give a folder")
        parent = next(p for p in (target, *target.parents) if p.exists())
    else:
        if target.is_dir():
            raise UsageError(f"{flag} {path}: is a folder; give a file name inside it")
        parent = target.parent
        if not parent.is_dir():
            raise UsageError(f"{flag} {path}: folder {str(parent)!r} does not exist; create it first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: folder {str(parent)!r} is not writable")
