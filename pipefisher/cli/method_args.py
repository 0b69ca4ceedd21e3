"""The command-line flags of the registered curvature methods, derived from their declarations:
`--<method>-placement`, `--<method>-refresh-steps` for every method and `--<method>-<key>` for the
keys a method names in `CurvatureMethod.flags`. Pure Python."""

from __future__ import annotations

import argparse
import typing
from typing import Any, Literal

from pipefisher.cli.args import positive_int
from pipefisher.config import FIRST_ORDER
from pipefisher.methods.registry import methods

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
        return {"type": positive_int}
    if annotation is float:
        return {"type": float, "metavar": "X"}
    return {"type": str}


def add_method_arguments(parser: argparse.ArgumentParser) -> None:
    """Every registered method's flags; each overrides its section's key of the run file."""
    for name, method in methods().items():
        hints = typing.get_type_hints(method.settings)
        for key in COMMON_FLAGS + method.flags:
            what = {"placement": f"where {method.label} work runs", "refresh_steps": "pin the refresh interval k"}.get(key, "override")
            parser.add_argument(_flag(name, key), dest=f"{name}_{key}", **_argument_type(hints[key]), help=f"{what} ({name}.{key})")


def method_overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """{method: {key: value}} of the method flags given (None: not given)."""
    return {name: {key: getattr(args, f"{name}_{key}") for key in COMMON_FLAGS + method.flags}
            for name, method in methods().items()}
