"""The stable profile format `pipefisher.profile/v1`: per-stage and per-layer op times.

All times are in the profile's `time_unit` (ms by default). Forward, backward and curvature times
are per micro-batch; inverse and sync times per refresh; precondition, gradient reduction and
step end per step.
Loading checks every field and names the bad one (e.g. ``stages[1].layers[0].inverse_a``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from pipefisher.files import load_structured

SCHEMA = "pipefisher.profile/v1"
#: stage times a file may leave out (0)
_OPTIONAL_STAGE_TIMES = ("step_end", "grad_reduce")
TIME_UNITS = ("s", "ms", "us", "units")


class ProfileError(ValueError):
    """A profile is malformed; the message names the field and how to fix it."""


@dataclass(frozen=True)
class LayerProfile:
    """K-FAC costs of one Linear layer of a stage."""

    name: str
    curvature_a: float
    curvature_b: float
    inverse_a: float
    inverse_b: float
    precondition: float
    sync_a: float = 0.0
    sync_b: float = 0.0


@dataclass(frozen=True)
class StageProfile:
    """Costs of one pipeline stage; `p2p` is the transfer time to the next stage; `grad_reduce`
    the all-reduce of the stage's gradient over its replicas, which starts once the stage's
    gradient is final (after its last backward, or its preconditioning) and overlaps the device's
    other work; `step_end` the rest of the stage's end of step after its last op (tied weights,
    clipping, optimizer step; in profiles without `grad_reduce`, the all-reduce too), which a
    device holding several stages pays once per stage."""

    forward: float
    backward: float
    p2p: float = 0.0
    step_end: float = 0.0
    grad_reduce: float = 0.0
    layers: tuple[LayerProfile, ...] = ()

    @property
    def curvature_time(self) -> float:
        """Curvature A and B of all layers for one micro-batch."""
        return sum(layer.curvature_a + layer.curvature_b for layer in self.layers)

    @property
    def inverse_time(self) -> float:
        """Inverting all factors once."""
        return sum(layer.inverse_a + layer.inverse_b for layer in self.layers)


@dataclass(frozen=True)
class Profile:
    stages: tuple[StageProfile, ...]
    time_unit: str = "ms"
    device: str = ""
    micro_batch_size: int | None = None

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def require_stages(self, num_stages: int, hint: str = "") -> "Profile":
        """Return self if it has `num_stages` stages, else raise ProfileError."""
        if self.num_stages != num_stages:
            raise ProfileError(
                f"profile has {self.num_stages} stages but the schedule needs {num_stages}"
                + (f" ({hint})" if hint else "")
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        """The file's fields; `step_end` and `grad_reduce` only where they are non-zero (files stay
        as before without them)."""
        data: dict[str, Any] = {"schema": SCHEMA, "device": self.device, "time_unit": self.time_unit}
        if self.micro_batch_size is not None:
            data["micro_batch_size"] = self.micro_batch_size
        data["stages"] = [
            {
                **{k: v for k, v in asdict(stage).items() if k != "layers" and (k not in _OPTIONAL_STAGE_TIMES or v)},
                "layers": [asdict(layer) for layer in stage.layers],
            }
            for stage in self.stages
        ]
        return data

    def save(self, path: str | Path) -> None:
        """Write YAML, or JSON when the suffix is .json."""
        path = Path(path)
        data = self.to_dict()
        text = json.dumps(data, indent=1) if path.suffix == ".json" else yaml.safe_dump(data, sort_keys=False)
        path.write_text(text if text.endswith("\n") else text + "\n")


def uniform_profile(num_stages: int, forward: float = 1.0, backward: float = 2.0, p2p: float = 0.0) -> Profile:
    """Identical stages without K-FAC layers, in abstract time units."""
    stage = StageProfile(forward=forward, backward=backward, p2p=p2p)
    return Profile(stages=(stage,) * num_stages, time_unit="units", device="uniform")


def _time(data: dict, key: str, where: str, required: bool = True) -> float:
    if key not in data:
        if required:
            raise ProfileError(f"{where}.{key}: missing; give a time in the profile's time_unit")
        return 0.0
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ProfileError(f"{where}.{key}: {value!r} is not a finite number")
    if value < 0:
        raise ProfileError(f"{where}.{key}: {value} is negative; times must be >= 0")
    return float(value)


def _reject_unknown(data: dict, cls: type, where: str, extra: tuple[str, ...] = ()) -> None:
    known = {f.name for f in fields(cls)} | set(extra)
    unknown = sorted(set(data) - known)
    if unknown:
        raise ProfileError(f"{where}: unknown field {unknown[0]!r}; known fields are {', '.join(sorted(known))}")


def _mapping(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise ProfileError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def _layer(data: Any, where: str) -> LayerProfile:
    data = _mapping(data, where)
    _reject_unknown(data, LayerProfile, where)
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise ProfileError(f"{where}.name: missing; give the layer's module name")
    times = {key: _time(data, key, where) for key in ("curvature_a", "curvature_b", "inverse_a", "inverse_b", "precondition")}
    syncs = {key: _time(data, key, where, required=False) for key in ("sync_a", "sync_b")}
    return LayerProfile(name=name, **times, **syncs)


def _stage(data: Any, where: str) -> StageProfile:
    data = _mapping(data, where)
    _reject_unknown(data, StageProfile, where)
    layers = data.get("layers") or []
    if not isinstance(layers, list):
        raise ProfileError(f"{where}.layers: expected a list of layers")
    parsed = tuple(_layer(layer, f"{where}.layers[{i}]") for i, layer in enumerate(layers))
    names = [layer.name for layer in parsed]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise ProfileError(f"{where}.layers: layer name {duplicate!r} appears twice")
    return StageProfile(
        forward=_time(data, "forward", where),
        backward=_time(data, "backward", where),
        p2p=_time(data, "p2p", where, required=False),
        step_end=_time(data, "step_end", where, required=False),
        grad_reduce=_time(data, "grad_reduce", where, required=False),
        layers=parsed,
    )


def profile_from_dict(data: Any) -> Profile:
    data = _mapping(data, "profile")
    _reject_unknown(data, Profile, "profile", extra=("schema",))
    schema = data.get("schema", SCHEMA)
    if schema != SCHEMA:
        raise ProfileError(f"schema: {schema!r} is not supported; expected {SCHEMA!r}")
    unit = data.get("time_unit", "ms")
    if unit not in TIME_UNITS:
        raise ProfileError(f"time_unit: {unit!r} is not one of {', '.join(TIME_UNITS)}")
    mbs = data.get("micro_batch_size")
    if mbs is not None and (isinstance(mbs, bool) or not isinstance(mbs, int) or mbs < 1):
        raise ProfileError(f"micro_batch_size: {mbs!r} must be a positive integer")
    stages = data.get("stages")
    if not isinstance(stages, list) or not stages:
        raise ProfileError("stages: missing; give one entry per pipeline stage")
    return Profile(
        stages=tuple(_stage(stage, f"stages[{i}]") for i, stage in enumerate(stages)),
        time_unit=unit,
        device=str(data.get("device", "")),
        micro_batch_size=mbs,
    )


def load_profile(path: str | Path) -> Profile:
    """Read a profile from YAML or JSON (JSON when the suffix is .json)."""
    return load_structured(path, "profile", profile_from_dict, ProfileError)


__all__ = [
    "SCHEMA",
    "LayerProfile",
    "StageProfile",
    "Profile",
    "ProfileError",
    "load_profile",
    "profile_from_dict",
    "uniform_profile",
]
