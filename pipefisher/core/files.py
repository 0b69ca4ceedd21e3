"""Reading structured files (YAML, or JSON by suffix) with one-line errors, and writing files so
that no reader ever sees a part of one. Pure Python."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")

#: YAML 1.2's floats (and Python's `float()`'s) where YAML 1.1 needs a dot and a signed exponent:
#: 1e-3, 3E-2, 1.5e3, .5, 1_000.5 (PyYAML's own resolver reads 1e-3 as the string '1e-3')
_FLOAT = re.compile(
    r"""^[-+]?(?:
      [0-9][0-9_]*(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)?
    | \.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
    | \.(?:inf|Inf|INF))$
    | ^\.(?:nan|NaN|NAN)$""",
    re.X,
)


_DUPLICATE = "is written twice in this mapping; keep one"


class NumberLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that reads numbers as YAML 1.2 and people write them (`_FLOAT`; integers
    stay integers) and refuses a key written twice in one mapping (YAML 1.1 keeps the last in silence)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"{key!r} {_DUPLICATE}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


# after PyYAML's int resolver, so that 1000 stays an int and 1e3 becomes a float
NumberLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))
NumberLoader.add_constructor("tag:yaml.org,2002:map", NumberLoader.construct_mapping)


def parse_yaml(text: str) -> Any:
    """The YAML `text` as `NumberLoader` reads it (run files, profiles, `--SECTION.KEY VALUE`)."""
    return yaml.load(text, Loader=NumberLoader)  # noqa: S506 - a SafeLoader


#: PyYAML's problems in words that say how to fix them
_PROBLEMS = (
    ("found character '\\t' that cannot start any token", "a tab character; YAML indents with spaces"),
    ("could not find expected ':'", "a key without its ':'; write `key: value`"),
    (
        "mapping values are not allowed here",
        "a ':' where no key may start; is the line above missing its ':', or is this line indented deeper than its neighbours?",
    ),
)


def yaml_problem(exc: yaml.YAMLError, path: str) -> str:
    """One line `path:line:column: what is wrong` for a YAML error (1-based place, where PyYAML knows it)."""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0] or type(exc).__name__
    said = (
        problem
        if problem.endswith(_DUPLICATE)
        else next((words for known, words in _PROBLEMS if problem.startswith(known)), None)
    )
    mark = getattr(exc, "problem_mark", None)
    if problem.startswith("could not find expected ':'"):
        mark = getattr(exc, "context_mark", None) or mark  # where the key began, not the line after
    if said is None:
        context = getattr(exc, "context", None)
        said = f"not valid YAML: {problem}" + (f" ({context})" if context else "")
    return f"{path}:{mark.line + 1}:{mark.column + 1}: {said}" if mark is not None else f"{path}: {said}"


def load_structured(
    path: str | Path, what: str, build: Callable[[Any], T], error: type[ValueError], schema: str | None = None
) -> T:
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
    try:
        data = json.loads(text) if path.suffix == ".json" else parse_yaml(text)
    except json.JSONDecodeError as exc:
        raise error(f"{path}:{exc.lineno}:{exc.colno}: not valid JSON: {exc.msg}") from None
    except yaml.YAMLError as exc:
        raise error(yaml_problem(exc, str(path))) from None
    other = data.get("schema") if isinstance(data, dict) else None
    if (
        isinstance(other, str)
        and other.startswith("pipefisher.")
        and other.split("/")[0] != (schema or "").split("/")[0]
    ):
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

    def write(temporary: Path) -> None:
        temporary.write_text(text)

    write_atomically(path, write)
