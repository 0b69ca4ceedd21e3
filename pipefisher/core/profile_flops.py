"""The flops of a profile's tasks and the rates they are compared with (optional profile fields),
and the achieved FLOP/s of each task kind. Pure Python.

A layer's ``flops`` (time key -> floating-point operations of one execution of that task, as its
time is: curvature per micro-batch, refresh per refresh, precondition and fold per step; the method's
count, `pipefisher.methods.flops`; ``step_end``: the layer's share of the method's end of step,
timed per stage) and the profile's ``flop_rates`` (`FlopRates`) are absent from
files written before them, and from profiles of methods that declare no counts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pipefisher.core.profile_checks import Frozen, ProfileError, mapping

#: the flop key of a layer's share of its method's work in the end of step (Shampoo's and SOAP's
#: preconditioning, per step), whose time is its stage's (`StageProfile.method_step_end`)
STEP_END_FLOPS = "step_end"
#: seconds per unit of a profile's time_unit ("units": abstract, no rate)
SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


def _count(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ProfileError(f"{where}: {value!r} is not a finite number >= 0")
    return float(value)


def check_flops(data: Any, known: Any, where: str) -> Frozen[float]:
    """A layer's flops: time keys `known(key)` accepts, each a finite count >= 0."""
    data = mapping(data, where)
    for key in data:
        if not known(key):
            raise ProfileError(f"{where}.{key}: unknown time field; a docs/profile-format.md time field")
    return Frozen({key: _count(value, f"{where}.{key}") for key, value in data.items()})


@dataclass(frozen=True)
class FlopRates:
    """What a profile's achieved FLOP/s are compared with: `dtypes` (work -> the dtype its bulk
    runs in: {"refresh": "float64"}; "tf32" for float32 products on tensor cores), `peaks` (dtype
    -> dense FLOP/s of the device: its published peak, `pipefisher.core.peaks`, or, `measured`,
    a large matrix product's rate timed on it)."""

    dtypes: Mapping[str, str] = field(default_factory=Frozen)
    peaks: Mapping[str, float] = field(default_factory=Frozen)
    measured: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtypes", Frozen(self.dtypes))
        object.__setattr__(self, "peaks", Frozen(self.peaks))

    def to_dict(self) -> dict[str, Any]:
        return {"dtypes": dict(self.dtypes), "peaks": dict(self.peaks), "measured": self.measured}

    @staticmethod
    def from_dict(data: Any, where: str = "flop_rates") -> FlopRates:
        """The checked field of a file; ProfileError naming the bad entry."""
        data = mapping(data, where)
        unknown = sorted(set(data) - {"dtypes", "peaks", "measured"})
        if unknown:
            raise ProfileError(f"{where}: unknown field {unknown[0]!r}; known fields are dtypes, measured, peaks")
        dtypes = mapping(data.get("dtypes", {}), f"{where}.dtypes")
        for work, dtype in dtypes.items():
            if not isinstance(dtype, str) or not dtype:
                raise ProfileError(f"{where}.dtypes.{work}: {dtype!r} must name a dtype, e.g. float32")
        peaks = mapping(data.get("peaks", {}), f"{where}.peaks")
        measured = data.get("measured", False)
        if not isinstance(measured, bool):
            raise ProfileError(f"{where}.measured: {measured!r} must be true or false")
        checked = {dtype: _count(value, f"{where}.peaks.{dtype}") for dtype, value in peaks.items()}
        return FlopRates(dtypes, checked, measured)


@dataclass(frozen=True)
class TaskRate:
    """The achieved rate of one task kind (`work`, `part`: None for precondition, fold and step_end) over every
    layer of every stage with a flop count: `flops` and `seconds` summed over them (one execution
    each), the `dtype` it runs in and the device's `peak` FLOP/s for it (None: unknown)."""

    work: str
    part: int | None
    flops: float
    seconds: float
    dtype: str
    peak: float | None

    @property
    def rate(self) -> float:
        """Achieved FLOP/s."""
        return self.flops / self.seconds

    @property
    def share(self) -> float | None:
        """The achieved share of the peak (0.5 = 50 %); None without a peak."""
        return self.rate / self.peak if self.peak else None


def task_rates(profile: Any) -> list[TaskRate]:
    """The `TaskRate` of each task kind of `profile` (a `Profile`) that has flops and a time in
    seconds-based units, in time-key order (curvature and refresh by part, precondition, fold, then the
    method's end of step: its layers' ``step_end`` flops over their stage's `method_step_end`)."""
    scale = SECONDS.get(profile.time_unit)
    if scale is None:
        return []
    totals: dict[str, list[float]] = {}

    def add(key: str, flops: float, seconds: float) -> None:
        if flops and seconds > 0:
            total = totals.setdefault(key, [0.0, 0.0])
            total[0] += flops
            total[1] += seconds

    for stage in profile.stages:
        for layer in stage.layers:
            for key, flops in layer.flops.items():
                work, _, part = key.partition(".")
                if key != STEP_END_FLOPS:
                    add(key, flops, layer.time(work, int(part) if part else None) * scale)
        step_end = sum(layer.flops.get(STEP_END_FLOPS, 0.0) for layer in stage.layers)
        add(STEP_END_FLOPS, step_end, stage.method_step_end * scale)
    rates = profile.flop_rates or FlopRates()
    found = []
    for key in sorted(totals, key=_key_order):
        work, _, part = key.partition(".")
        dtype = rates.dtypes.get(work, "")
        found.append(
            TaskRate(work, int(part) if part else None, totals[key][0], totals[key][1], dtype, rates.peaks.get(dtype))
        )
    return found


def _key_order(key: str) -> tuple[int, str]:
    return ("curvature", "sync", "refresh", "precondition", "fold", STEP_END_FLOPS).index(key.partition(".")[0]), key
