"""The registry of model kinds: the built-in ones (`pipefisher.models.kinds`), those a program
registers (`register`) and those installed packages declare under the entry-point group
``pipefisher.models`` (each entry a `ModelKind`). Everything outside a kind's declaration and
builder finds the kind here, by its `model.kind` name. Pure Python: no torch.

A name is taken once, and a broken or clashing plugin is skipped with one warning line, as method
plugins are (`pipefisher.core.plugins.PluginRegistry`).

Ranks a run launches know a registered kind when they import the module that registers it (a
test's worker function lives in that module, so unpickling it imports the module), or when it is
an installed plugin (each rank reads the entry points itself)."""

from __future__ import annotations

from typing import Any

from pipefisher.core.plugins import PluginRegistry
from pipefisher.core.settings import ConfigError
from pipefisher.models.kind import ModelKind
from pipefisher.models.kinds import BUILT_IN

ENTRY_POINT_GROUP = "pipefisher.models"

_REGISTRY = PluginRegistry("model kind", ModelKind, ENTRY_POINT_GROUP, BUILT_IN, name_of=lambda kind: kind.name)
#: make a kind known by its name (returns it; ValueError if another kind has the name); forget one
#: (built-in kinds stay)
register, unregister = _REGISTRY.register, _REGISTRY.unregister


def kinds() -> dict[str, ModelKind]:
    """Every known kind by name, built-in ones first, then those registered or installed."""
    return _REGISTRY.known()


def model_kind(name: str) -> ModelKind:
    """Kind `name`; ConfigError naming `model.kind` and the known kinds otherwise."""
    known = _REGISTRY.known()
    if name not in known:
        raise ConfigError(f"model.kind: {name!r} is not one of {', '.join(known)}")
    return known[name]


def preload_of(model: Any) -> tuple[str, ...]:
    """The modules a run of `model` (its `ModelConfig`) has its launcher's forkserver import
    (`ModelKind.preload`); none for an unknown kind (the run's checks name it)."""
    known = _REGISTRY.known()
    return known[model.kind].preload(model) if model.kind in known else ()


def readers(key: str) -> tuple[str, ...]:
    """The names of the kinds that read `model` key `key`, in registry order."""
    return tuple(name for name, kind in _REGISTRY.known().items() if kind.reads(key))
