"""A layer's costs in a profile (`pipefisher.core.profile`): the times of its method's tasks by
part (`LayerProfile`), and the keys that name them (`time_key`: ``refresh.1``, ``precondition``,
``fold``). Pure Python."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import KW_ONLY, dataclass, field, replace
from typing import Any

from pipefisher.core.profile_checks import Frozen, Samples, check_samples
from pipefisher.core.profile_flops import STEP_END_FLOPS, check_flops

#: the work of a layer that has a time per part, in file order
PART_WORK = ("curvature", "sync", "refresh")
_PART_KEY = re.compile(rf"^({'|'.join(PART_WORK)})\.(0|[1-9][0-9]*)$")
#: the work of a layer that has one time per step, in file order: its P op's share (`precondition`)
#: and its share of the method's fold of the step's gradient into its statistics (`fold`, the U op's)
STEP_WORK = ("precondition", "fold")


def time_key(work: str, part: int | None = None) -> str:
    """The key of a layer's time of `work` (one of `PART_WORK`, with its `part`; or one of
    `STEP_WORK`: "precondition", "fold")."""
    return work if part is None else f"{work}.{part}"


def _trimmed(values: Iterable[float]) -> tuple[float, ...]:
    """`values` without trailing zeros: a part past the end takes 0, so both mean the same."""
    found = [float(v) for v in values]
    while found and not found[-1]:
        found.pop()
    return tuple(found)


@dataclass(frozen=True)
class LayerProfile:
    """The costs of its method's tasks on one layer of a stage: per part (index) `curvature`,
    `sync` and `refresh` times and `capture_bytes`; per step, the `precondition` time (its share
    of the P op, or of a help op's work) and the `fold` time (its share of the U op: the method's
    fold of the step's gradient into its statistics, SOAP's; 0 for a method without one), both in
    the profile's time unit; `weight_bytes` (its weight's size: what a help op of its per-step work
    receives and sends back, 0 = unknown); `samples` keyed by `time_key`; `flops` (by `time_key`:
    of one execution; `STEP_END_FLOPS`: its share of the method's end of step, per step; absent =
    unknown). Lists are kept without trailing zeros (a missing part takes 0). A plain mapping
    given as `samples` is checked and stored as `Samples`."""

    name: str
    _: KW_ONLY
    curvature: tuple[float, ...] = ()
    sync: tuple[float, ...] = ()
    refresh: tuple[float, ...] = ()
    precondition: float = 0.0
    fold: float = 0.0
    capture_bytes: tuple[int, ...] = ()
    weight_bytes: int = 0
    samples: Mapping[str, tuple[float, ...]] = field(default_factory=Samples)
    flops: Mapping[str, float] = field(default_factory=Frozen)

    def __post_init__(self) -> None:
        object.__setattr__(self, "flops", check_flops(self.flops, flop_key, "flops"))
        for work in PART_WORK:
            object.__setattr__(self, work, _trimmed(getattr(self, work)))
        object.__setattr__(self, "capture_bytes", tuple(int(b) for b in _trimmed(self.capture_bytes)))
        object.__setattr__(self, "samples", check_samples(self.samples, layer_key, "samples"))

    def time(self, work: str, part: int | None = None) -> float:
        """The time of `work` (one of `STEP_WORK`, or one of `PART_WORK` with its part)."""
        if part is None:
            return float(getattr(self, work))
        values = getattr(self, work)
        return values[part] if part < len(values) else 0.0

    def captured(self, part: int) -> int:
        """Bytes one micro-batch's capture of `part` holds (0 = unknown)."""
        return self.capture_bytes[part] if part < len(self.capture_bytes) else 0

    def with_times(self, times: Mapping[str, float]) -> LayerProfile:
        """This layer with the times of `times` (keyed by `time_key`) replaced."""
        changes: dict[str, Any] = {}
        for key, value in times.items():
            match = _PART_KEY.match(key)
            if match is None:
                changes[key] = value
                continue
            work, part = match[1], int(match[2])
            values = list(changes.get(work, getattr(self, work)))
            values += [0.0] * (part + 1 - len(values))
            values[part] = value
            changes[work] = tuple(values)
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The file's fields; part lists, `fold`, capture sizes and samples only where given (a
        layer without a fold writes what files written before that field hold)."""
        data: dict[str, Any] = {"name": self.name}
        data.update({work: list(getattr(self, work)) for work in PART_WORK if getattr(self, work)})
        data["precondition"] = self.precondition
        if self.fold:
            data["fold"] = self.fold
        if self.capture_bytes:
            data["capture_bytes"] = list(self.capture_bytes)
        if self.weight_bytes:
            data["weight_bytes"] = self.weight_bytes
        if self.samples:
            data["samples"] = {key: list(values) for key, values in self.samples.items()}
        if self.flops:
            data["flops"] = dict(self.flops)
        return data


def layer_key(key: str) -> bool:
    """Whether `key` names a layer time: one of `STEP_WORK` or `time_key` of a part's work."""
    return key in STEP_WORK or _PART_KEY.match(key) is not None


def flop_key(key: str) -> bool:
    """Whether `key` names a layer's flop count: a `layer_key`, or `STEP_END_FLOPS`."""
    return key == STEP_END_FLOPS or layer_key(key)
