"""The checks of a profile file's fields, shared by the readers of both of its versions. Pure Python."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import fields
from typing import Any, Generic, TypeVar


class ProfileError(ValueError):
    """A profile is malformed; the message names the field and how to fix it."""


V = TypeVar("V")


class Frozen(Mapping[str, V], Generic[V]):
    """An immutable, hashable mapping (a field of a frozen profile)."""

    def __init__(self, values: Mapping[str, V] | None = None) -> None:
        self._values = dict(values or {})

    def __getitem__(self, key: str) -> V:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._values.items())))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._values!r})"


class Samples(Frozen[tuple[float, ...]]):
    """Immutable, hashable mapping: time field -> its measured values (the field's unit)."""

    def __init__(self, values: Mapping[str, Iterable[float]] | None = None) -> None:
        super().__init__({name: tuple(float(v) for v in vs) for name, vs in (values or {}).items()})


def check_time(value: Any, where: str) -> float:
    """`value` as a time: a finite number >= 0; ProfileError naming `where` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ProfileError(f"{where}: {value!r} is not a finite number")
    if value < 0:
        raise ProfileError(f"{where}: {value} is negative; times must be >= 0")
    return float(value)


def time_field(data: Mapping, key: str, where: str, required: bool = True) -> float:
    """The time `data[key]` (0 when it is missing and not `required`)."""
    if key not in data:
        if required:
            raise ProfileError(f"{where}.{key}: missing; give a time in the profile's time_unit")
        return 0.0
    return check_time(data[key], f"{where}.{key}")


def byte_count(value: Any, where: str) -> int:
    """`value` as a size in bytes: a non-negative integer."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ProfileError(f"{where}: {value!r} is not a non-negative integer (bytes)")
    return value


def mapping(value: Any, where: str) -> Mapping:
    if not isinstance(value, Mapping):
        raise ProfileError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def check_samples(data: Any, known: Callable[[str], bool], where: str) -> Samples:
    """Checked samples: time fields `known(key)` accepts, each a non-empty list of finite times >= 0."""
    data = mapping(data, where)
    for key, values in data.items():
        if not known(key):
            raise ProfileError(f"{where}.{key}: unknown time field; a docs/profile-format.md time field")
        if not isinstance(values, (list, tuple)) or not values:
            raise ProfileError(f"{where}.{key}: expected a non-empty list of times")
        for i, value in enumerate(values):
            check_time(value, f"{where}.{key}[{i}]")
    return data if isinstance(data, Samples) else Samples(data)


def reject_unknown(data: Mapping, cls: type, where: str, extra: tuple[str, ...] = ()) -> None:
    """ProfileError naming the first key of `data` that is no field of `cls` (nor in `extra`)."""
    known = {f.name for f in fields(cls)} | set(extra)
    unknown = sorted(set(data) - known)
    if unknown:
        raise ProfileError(f"{where}: unknown field {unknown[0]!r}; known fields are {', '.join(sorted(known))}")


def part_list(data: Mapping, key: str, where: str, check: Any) -> tuple:
    """`data[key]`, a list by part index (empty when missing), each entry passed through `check`."""
    values = data.get(key, [])
    if not isinstance(values, list):
        raise ProfileError(f"{where}.{key}: expected a list by part index, e.g. [{key} of part 0, of part 1]")
    return tuple(check(value, f"{where}.{key}[{i}]") for i, value in enumerate(values))
