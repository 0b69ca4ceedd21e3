"""Reading structured files (YAML, or JSON by suffix) with one-line errors. Pure Python."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


def load_structured(path: str | Path, what: str, build: Callable[[Any], T], error: type[ValueError]) -> T:
    """`build(parsed content of path)`; any problem raises `error` naming the file (and `what` it is)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise error(f"cannot read {what} {str(path)!r}: {exc.strerror}") from None
    as_json = path.suffix == ".json"
    try:
        data = json.loads(text) if as_json else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise error(f"{path}: not valid {'JSON' if as_json else 'YAML'}: {first}") from None
    try:
        return build(data)
    except error as exc:
        raise error(f"{path}: {exc}") from None
