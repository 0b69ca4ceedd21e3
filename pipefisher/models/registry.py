"""The registry of model kinds: the built-in ones (`pipefisher.models.kinds`), those a program
registers (`register`) and those installed packages declare under the entry-point group
``pipefisher.models`` (each entry a `ModelKind`). Everything outside a kind's declaration and
builder finds the kind here, by its `model.kind` name. Pure Python: no torch.

A name is taken once: `register` refuses a second, different kind of a taken name, and an
installed plugin that does not load or whose name is taken is skipped with one warning line on
stderr (by the launching process, not again by each rank it starts), as method plugins are
(`pipefisher.methods.registry`): a broken or clashing plugin never breaks the runs that do not
use it, nor replaces a built-in kind.

Ranks a run launches know a registered kind when they import the module that registers it (a
test's worker function lives in that module, so unpickling it imports the module), or when it is
an installed plugin (each rank reads the entry points itself)."""

from __future__ import annotations

import multiprocessing
import sys
from importlib.metadata import EntryPoint, entry_points

from pipefisher.core.settings import ConfigError
from pipefisher.models.kind import ModelKind
from pipefisher.models.kinds import BUILT_IN

ENTRY_POINT_GROUP = "pipefisher.models"

_KINDS: dict[str, ModelKind] = {kind.name: kind for kind in BUILT_IN}
_entry_points_loaded = False


def register(kind: ModelKind) -> ModelKind:
    """Make `kind` known by its name; returns it. Registering the same object again is a no-op;
    ValueError if another kind has the name (`unregister` it first)."""
    taken = _KINDS.get(kind.name)
    if taken is not None and taken is not kind:
        origin = "a built-in kind" if _built_in(taken) else "another kind"
        raise ValueError(f"model kind {kind.name!r} is taken by {origin}; choose another name")
    _KINDS[kind.name] = kind
    return kind


def _built_in(kind: ModelKind | None) -> bool:
    return any(kind is built_in for built_in in BUILT_IN)


def unregister(name: str) -> None:
    """Forget kind `name` (tests that register one of their own); built-in kinds stay."""
    if not _built_in(_KINDS.get(name)):
        _KINDS.pop(name, None)


def _known() -> dict[str, ModelKind]:
    """The registry, with the installed plugins read in on first use."""
    global _entry_points_loaded
    if not _entry_points_loaded:
        _entry_points_loaded = True
        for entry in entry_points(group=ENTRY_POINT_GROUP):
            _register_plugin(entry)
    return _KINDS


def _register_plugin(entry: EntryPoint) -> None:
    """Register the model kind entry point `entry` names, or warn in one line why it is skipped."""
    plugin = f"model plugin {entry.name!r} (entry point {entry.value})"
    try:
        loaded = entry.load()
    except Exception as exc:  # anything its import raises: the host goes on without it
        detail = str(exc).splitlines()[0] if str(exc) else ""
        return _warn(f"{plugin} did not load: {type(exc).__name__}: {detail}; runs that do not use it work")
    if not isinstance(loaded, ModelKind):
        return _warn(f"{plugin} is a {type(loaded).__name__}, not a ModelKind; skipped")
    try:
        register(loaded)
    except ValueError as exc:
        _warn(f"{plugin}: {exc}; skipped")


def _warn(message: str) -> None:
    """One warning line on stderr, from the process a user started (a rank the local launcher
    started has a parent process and stays quiet: its launcher said it)."""
    if multiprocessing.parent_process() is None:
        print(f"pipefisher: warning: {message}", file=sys.stderr, flush=True)


def kinds() -> dict[str, ModelKind]:
    """Every known kind by name, built-in ones first, then those registered or installed."""
    return dict(_known())


def model_kind(name: str) -> ModelKind:
    """Kind `name`; ConfigError naming `model.kind` and the known kinds otherwise."""
    known = _known()
    if name not in known:
        raise ConfigError(f"model.kind: {name!r} is not one of {', '.join(known)}")
    return known[name]


def readers(key: str) -> tuple[str, ...]:
    """The names of the kinds that read `model` key `key`, in registry order."""
    return tuple(name for name, kind in _known().items() if kind.reads(key))
