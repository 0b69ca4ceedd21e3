"""The registry of model kinds: the built-in ones (`pipefisher.models.kinds`) and those a program
registers (`register`). Everything outside a kind's declaration and builder finds the kind here,
by its `model.kind` name. Pure Python: no torch.

Ranks a run launches know a registered kind when they import the module that registers it (a
test's worker function lives in that module, so unpickling it imports the module)."""

from __future__ import annotations

from pipefisher.core.settings import ConfigError
from pipefisher.models.kind import ModelKind
from pipefisher.models.kinds import BUILT_IN

_KINDS: dict[str, ModelKind] = {kind.name: kind for kind in BUILT_IN}


def register(kind: ModelKind) -> ModelKind:
    """Make `kind` known by its name; returns it. Registering the same object again is a no-op;
    ValueError if another kind has the name (`unregister` it first)."""
    taken = _KINDS.get(kind.name)
    if taken is not None and taken is not kind:
        raise ValueError(f"model kind {kind.name!r} is taken; choose another name")
    _KINDS[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    """Forget kind `name` (tests that register one of their own); built-in kinds stay."""
    if not any(_KINDS.get(name) is kind for kind in BUILT_IN):
        _KINDS.pop(name, None)


def kinds() -> dict[str, ModelKind]:
    """Every known kind by name, built-in ones first."""
    return dict(_KINDS)


def model_kind(name: str) -> ModelKind:
    """Kind `name`; ConfigError naming `model.kind` and the known kinds otherwise."""
    if name not in _KINDS:
        raise ConfigError(f"model.kind: {name!r} is not one of {', '.join(_KINDS)}")
    return _KINDS[name]


def readers(key: str) -> tuple[str, ...]:
    """The names of the kinds that read `model` key `key`, in registry order."""
    return tuple(name for name, kind in _KINDS.items() if kind.reads(key))
