"""Run settings declared once: each key of a run-file section is a dataclass field made by
`setting`, which carries its one line of documentation and its allowed range; `check_ranges`
validates a section against them, `described_keys` documents it. Pure Python."""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

_META = "pipefisher.setting"


class ConfigError(ValueError):
    """A bad run file or override; the message names the key and what is allowed."""


def closest(word: str, candidates: typing.Iterable[str]) -> str | None:
    """The candidate a mistyped `word` most likely meant (`difflib.get_close_matches`), None if none is close."""
    matches = difflib.get_close_matches(word, list(candidates), n=1)
    return matches[0] if matches else None


@dataclass(frozen=True)
class Ceiling:
    """The most a count can be that a run could reach, and why: a larger value is a typo, refused
    with `why` (the key's range text stays its natural one, e.g. "positive")."""

    most: int
    why: str


#: counts of steps: a billion steps are 12 days at 1 ms a step, 1000x the longest published training runs
STEP_CEILING = Ceiling(10**9, "more steps than any run takes (12 days at 1 ms a step)")
#: counts of processes and of pieces of a step: 2^20, 10x the largest accelerator clusters
COUNT_CEILING = Ceiling(2**20, "more than any cluster could run (2^20)")
#: the largest integer any key takes: a 64-bit signed integer (what torch, numpy and the OS hold)
MAX_INTEGER = 2**63 - 1


@dataclass(frozen=True)
class Range:
    """Allowed values of a number: `low`..`high` (None: unbounded), ends open or closed;
    `special`: values allowed outside the range (e.g. -1 = the model's own); `note` says what
    the special or boundary values mean; `ceiling`: the most a count may be (`Ceiling`)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    special: tuple[float, ...] = ()
    note: str = ""
    ceiling: Ceiling | None = None

    def contains(self, value: float) -> bool:
        return not self.problem(value)

    def problem(self, value: float) -> str:
        """What is wrong with `value` ("must be ...", "exceeds ..."), "" when it is allowed."""
        if value in self.special:
            return ""
        if self.ceiling is not None and value > self.ceiling.most:
            return f"exceeds {self.ceiling.most:,}, {self.ceiling.why}"
        if not math.isfinite(value):
            return f"must be {self}"
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return f"must be {self}"
        if self.high is not None and (value >= self.high if self.high_open else value > self.high):
            return f"must be {self}"
        return ""

    def __str__(self) -> str:
        if self.low is None and self.high is None:
            text = "any number"
        elif self.high is None:
            text = "positive" if self.low == 0 and self.low_open else f"{'>' if self.low_open else '>='} {self.low:g}"
        elif self.low is None:
            text = f"{'<' if self.high_open else '<='} {self.high:g}"
        else:
            text = f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        return text + "".join(f" or {value:g}" for value in self.special)


@dataclass(frozen=True)
class Setting:
    """What `setting` attaches to a field: its documentation line and its range (None: any)."""

    doc: str
    range: Range | None = None


def setting(
    default: Any,
    doc: str,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    special: tuple[float, ...] = (),
    note: str = "",
    ceiling: Ceiling | None = None,
) -> Any:
    """A run-file key: a dataclass field with `default`, one line of `doc` and, for numbers, the
    range low..high (open ends as flagged) with `special` values allowed besides, and for counts
    the `ceiling` no run reaches."""
    bounded = low is not None or high is not None or ceiling is not None
    declared = Setting(doc, Range(low, high, low_open, high_open, special, note, ceiling) if bounded else None)
    if isinstance(default, (list, dict, set)):
        raise TypeError("a setting's default must be immutable (use a tuple)")
    return dataclasses.field(default=default, metadata={_META: declared})


def declared(field: dataclasses.Field) -> Setting:
    """The declaration of a field made by `setting` (TypeError for another field)."""
    if _META not in field.metadata:
        raise TypeError(f"{field.name}: a run-file key must be declared with `setting`")
    return field.metadata[_META]


def check_ranges(section: Any, where: str, label: Callable[[str], str] | None = None) -> None:
    """ConfigError naming `where`.key (or `label(key)`: a command-line flag) for the first number
    outside its declared range or ceiling, or an integer beyond 64 bits (each element of a tuple
    on its own, named `key[i]`)."""
    for field in dataclasses.fields(section):
        allowed = declared(field).range
        value = getattr(section, field.name)
        values = value if isinstance(value, tuple) else (value,)
        for index, element in enumerate(values):
            if isinstance(element, bool) or not isinstance(element, (int, float)):
                continue
            problem = allowed.problem(element) if allowed is not None else ""
            if not problem and isinstance(element, int) and abs(element) > MAX_INTEGER:
                problem = "is beyond a 64-bit integer"
            if problem:
                name = (label(field.name) if label else f"{where}.{field.name}") + (
                    f"[{index}]" if isinstance(value, tuple) else ""
                )
                note = (
                    f" ({allowed.note})" if allowed is not None and allowed.note and problem.startswith("must") else ""
                )
                shown = element if isinstance(element, int) else f"{element:g}"
                raise ConfigError(f"{name}: {shown} {problem}{note}")


def check_section(section: Any, where: str) -> None:
    """`check_ranges`, and first ConfigError naming `where`.key for a value outside its key's
    `Literal` choices or an integer key holding another number: the checks a run file's values
    get (`pipefisher.config.run`) for a section built in code (an engine's settings)."""
    hints = typing.get_type_hints(type(section))
    for field in dataclasses.fields(section):
        annotation, value = hints[field.name], getattr(section, field.name)
        if typing.get_origin(annotation) is Literal and value not in typing.get_args(annotation):
            raise ConfigError(f"{where}.{field.name}: {value!r} is not {type_name(annotation)}")
        if annotation is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"{where}.{field.name}: expected an integer, got {value!r}")
    check_ranges(section, where)


def type_name(annotation: Any) -> str:
    """A field's type as the run file writes it: int, number, text, true/false, one of a, b, list."""
    if typing.get_origin(annotation) is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(annotation)))
    if typing.get_origin(annotation) is tuple and typing.get_args(annotation)[-1] is Ellipsis:
        return f"list of {type_name(typing.get_args(annotation)[0])}s"
    if typing.get_origin(annotation) is tuple:
        return f"list of {len(typing.get_args(annotation))} numbers"
    return {int: "integer", float: "number", str: "text", bool: "true/false"}.get(annotation, str(annotation))


@dataclass(frozen=True)
class DescribedKey:
    """One key of a section as the documentation shows it."""

    name: str
    type: str
    default: Any
    range: Range | None
    doc: str


def described_keys(section: type) -> list[DescribedKey]:
    """Every key of a section class, in declaration order."""
    hints = typing.get_type_hints(section)
    return [
        DescribedKey(
            field.name, type_name(hints[field.name]), field.default, declared(field).range, declared(field).doc
        )
        for field in dataclasses.fields(section)
    ]
