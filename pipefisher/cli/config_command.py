"""`pipefisher config`: a run file resolved (every key with the value it takes), or the reference
of every run-file key, both from the declarations. Pure Python."""

from __future__ import annotations

import argparse

from pipefisher.cli.args import UsageError
from pipefisher.cli.run_file_args import add_key_arguments, key_overrides, load_run


def add_config_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "config",
        help="print a run file resolved, or the reference of every run-file key",
        description="--show RUN.yaml prints the run as pipefisher takes it: every section and key with its "
        "value (defaults filled in, --SECTION.KEY VALUE flags applied); --keys prints every "
        "key's type, default, range and meaning (Markdown, as docs/run-file-keys.md).",
    )
    parser.add_argument("--show", metavar="RUN.yaml", help="the run file to resolve")
    parser.add_argument("--keys", action="store_true", help="the reference of every run-file key")
    add_key_arguments(parser)
    parser.set_defaults(handler=_cmd_config)


def _cmd_config(args: argparse.Namespace) -> int:
    from pipefisher.config.reference import resolved_yaml, run_file_reference

    if args.keys == (args.show is not None):
        raise UsageError("give --show RUN.yaml (the resolved run) or --keys (the reference of every key), one of them")
    if args.keys:
        if key_overrides(args):
            raise UsageError("--SECTION.KEY flags apply to --show; --keys prints the declarations")
        print(run_file_reference(), end="")
        return 0
    args.config = args.show
    print(resolved_yaml(load_run(args)), end="")
    return 0
