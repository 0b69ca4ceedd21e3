"""Command-line flags derived from the run-file declarations: `--SECTION.KEY VALUE` for every key
of every section (as torchtitan derives its flags), and the short flags of the registered
curvature methods: `--<method>-placement`, `--<method>-refresh-steps` and `--<method>-<key>` for
the keys a method names in `CurvatureMethod.flags`; and `pipefisher pack`'s flags, the placement
keys of a method's section. Pure Python."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, Literal

import yaml

from pipefisher.cli.args import UsageError, positive_int, whole
from pipefisher.config import FIRST_ORDER, RunConfig, load_config
from pipefisher.core.files import parse_yaml
from pipefisher.core.settings import check_ranges, declared
from pipefisher.methods.registry import methods
from pipefisher.methods.settings import RefreshConfig

#: the keys every method's section has a flag for
COMMON_FLAGS = ("placement", "refresh_steps")


def optimizer_names() -> tuple[str, ...]:
    """`optimizer.name` choices: the first-order optimizers, then every registered method."""
    return FIRST_ORDER + tuple(methods())


def _flag(name: str, key: str) -> str:
    return f"--{name}-{key.replace('_', '-')}"


def _argument_type(annotation: Any) -> dict[str, Any]:
    if typing.get_origin(annotation) is Literal:
        return {"choices": list(typing.get_args(annotation))}
    if annotation is int:
        return {"type": positive_int, "metavar": "K"}
    if annotation is float:
        return {"type": float, "metavar": "F"}
    return {"type": str}


def add_method_arguments(parser: argparse.ArgumentParser) -> None:
    """Every registered method's flags; each overrides its section's key of the run file."""
    for name, method in methods().items():
        hints = typing.get_type_hints(method.settings)
        for key in COMMON_FLAGS + method.flags:
            what = {"placement": f"where {method.label} work runs", "refresh_steps": "pin the refresh interval k"}.get(
                key, "override"
            )
            parser.add_argument(
                _flag(name, key), dest=f"{name}_{key}", **_argument_type(hints[key]), help=f"{what} ({name}.{key})"
            )


def method_overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """{method: {key: value}} of the method flags given (None: not given)."""
    return {
        name: {key: getattr(args, f"{name}_{key}") for key in COMMON_FLAGS + method.flags}
        for name, method in methods().items()
    }


def _sections() -> dict[str, type]:
    """Every run-file section's class by name, methods' from the registry."""
    hints = typing.get_type_hints(RunConfig)
    sections = {field.name: hints[field.name] for field in dataclasses.fields(RunConfig) if field.name != "methods"}
    return {**sections, **{name: method.settings for name, method in methods().items()}}


#: what `run --help` and `profile --help` say after their flags
KEY_FLAGS_EPILOG = (
    "Every run-file key is also a flag --SECTION.KEY VALUE (e.g. --optimizer.lr 0.001, --data.cache_dir DIR), "
    "applied over the run file; `pipefisher config --keys` lists them all (docs/run-file-keys.md)."
)


def add_key_arguments(parser: argparse.ArgumentParser) -> None:
    """`--SECTION.KEY VALUE` for every key (not listed one by one in --help, which says they exist:
    docs/run-file-keys.md lists them)."""
    parser.epilog = KEY_FLAGS_EPILOG
    for section, cls in _sections().items():
        for field in dataclasses.fields(cls):
            parser.add_argument(
                f"--{section}.{field.name}", dest=f"key:{section}.{field.name}", metavar="VALUE", help=argparse.SUPPRESS
            )


def key_overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """{section: {key: value}} of the `--SECTION.KEY VALUE` flags given, each VALUE read as YAML."""
    overrides: dict[str, dict[str, Any]] = {}
    for dest, text in vars(args).items():
        if dest.startswith("key:") and text is not None:
            section, key = dest[len("key:") :].split(".", 1)
            try:
                value = parse_yaml(text)
            except yaml.YAMLError:
                raise UsageError(f"--{section}.{key}: {text!r} is not a YAML value") from None
            overrides.setdefault(section, {})[key] = text if value is None else value
    return overrides


def load_run(args: argparse.Namespace) -> RunConfig:
    """The run file `args.config` with the `--SECTION.KEY VALUE` flags applied (checked as the file is)."""
    config = load_config(args.config)
    overrides = key_overrides(args)
    return config.with_overrides(**overrides) if overrides else config


#: the placement keys `pipefisher pack` takes as flags (and --no-split for `split`)
PACK_KEYS = ("margin", "percentile", "max_overhead", "refresh_steps", "max_refresh_steps", "max_capture_mb")


def _flag_name(key: str) -> str:
    return "--" + key.replace("_", "-")


def add_placement_arguments(parser: argparse.ArgumentParser) -> None:
    """A flag per key of `PACK_KEYS`, typed, documented and defaulted by its declaration in `RefreshConfig`."""
    hints = typing.get_type_hints(RefreshConfig)
    for field in dataclasses.fields(RefreshConfig):
        if field.name in PACK_KEYS:
            setting = declared(field)
            note = setting.range.note if setting.range is not None else ""
            allowed = f"{setting.range}" + (f", {note}" if note else "")
            parser.add_argument(
                _flag_name(field.name),
                type=whole if hints[field.name] is int else float,
                metavar="K" if hints[field.name] is int else "X",
                help=f"{setting.doc} ({allowed}; default {field.default:g})",
            )
    parser.add_argument("--no-split", action="store_true", help="every replica does its own refresh work (split false)")
    parser.add_argument(
        "--helpers",
        action="store_true",
        help="hand layers of per-step work with no bubble to other ranks where the step gets shorter (helpers "
        "true; methods whose rules allow it; the profile's p2p_bytes and weight_bytes cost the link)",
    )


def placement_section(args: argparse.Namespace) -> RefreshConfig:
    """The section the placement flags describe (defaults where not given); ConfigError naming the flag out of range."""
    given = {key: getattr(args, key) for key in PACK_KEYS if getattr(args, key) is not None}
    section = dataclasses.replace(RefreshConfig(), split=not args.no_split, helpers=args.helpers, **given)
    check_ranges(section, "", label=_flag_name)
    return section
