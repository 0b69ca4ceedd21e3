"""Reading structured files (YAML, or JSON by suffix) with one-line errors, and writing files so
that no reader ever sees a part of one. Pure Python."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


def load_structured(path: str | Path, what: str, build: Callable[[Any], T], error: type[ValueError],
                    schema: str | None = None) -> T:
    """`build(parsed content of path)`; any problem raises `error` naming the file (and `what` it
    is): unreadable, a folder, not text, empty, not YAML/JSON, or a pipefisher file of another
    kind than `schema` says (its own `schema` field names the kind; `schema` None: a file without
    one, such as a run file)."""
    path = Path(path)
    if path.is_dir():
        raise error(f"{what} {str(path)!r} is a folder; give the {what}'s file")
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise error(f"cannot read {what} {str(path)!r}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise error(f"{path}: not a text file; a {what} is YAML or JSON text") from None
    if not text.strip():
        raise error(f"{path}: the {what} is empty")
    as_json = path.suffix == ".json"
    try:
        data = json.loads(text) if as_json else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise error(f"{path}: not valid {'JSON' if as_json else 'YAML'}: {first}") from None
    other = data.get("schema") if isinstance(data, dict) else None
    if isinstance(other, str) and other.startswith("pipefisher.") and other.split("/")[0] != (schema or "").split("/")[0]:
        kind = other.split(".", 1)[1].split("/")[0]
        raise error(f"{path} is a pipefisher {kind} file ({other}), not a {what}")
    try:
        return build(data)
    except error as exc:
        raise error(f"{path}: {exc}") from None


def write_atomically(path: str | Path, write: Callable[[Path], None], durable: bool = False) -> None:
    """`write(temporary)` beside `path` (same suffix), then rename it to `path`: a reader, or a
    later run after this one was interrupted at any moment, finds the old file or the whole new
    one. A failed or interrupted `write` leaves nothing. `durable`: flushed to disk before the
    rename (checkpoints)."""
    path = Path(path)
    temporary = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    try:
        write(temporary)
        if durable:
            with open(temporary, "rb+") as handle:
                os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def write_folder_atomically(folder: str | Path, write: Callable[[Path], None]) -> None:
    """`write(temporary folder)` beside `folder`, then the folder renamed into place when it did
    not exist (one rename: readers see all of it or none), else each file moved in by one rename.
    A failed or interrupted `write` leaves nothing."""
    folder = Path(folder)
    temporary = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    try:
        temporary.mkdir(parents=True)
        write(temporary)
        if not folder.exists():
            os.replace(temporary, folder)
            return
        for path in temporary.iterdir():
            os.replace(path, folder / path.name)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    temporary.rmdir()


def write_text_atomically(path: str | Path, text: str) -> None:
    """`text` into `path` through `write_atomically`."""
    write_atomically(path, lambda temporary: temporary.write_text(text))


def experiment_output(name: str) -> Path:
    """Where an experiment writes unless told otherwise (its --out): a folder of the temporary
    directory, never a tracked file of the checkout (the README's figures are rewritten only by
    naming them)."""
    return Path(tempfile.gettempdir()) / "pipefisher-experiments" / name
