"""The stable profile format `pipefisher.profile/v1`: per-stage and per-layer op times.

All times are in the profile's `time_unit` (ms by default). Forward, backward and curvature times
are per micro-batch; inverse and sync times per refresh; precondition, gradient reduction and
step end per step.
Loading checks every field and names the bad one (e.g. ``stages[1].layers[0].inverse_a``).

Optional additions, each absent from files written before it (read as before; docs/profile-format.md
has every field): ``samples`` of a stage or layer (the measured repeats of each time field, whose
median the field is; ``Profile.at_percentile(q)`` takes their q-th percentile instead);
``capture_a_bytes`` / ``capture_b_bytes`` of a layer (bytes one micro-batch's capture holds; 0 =
unknown); ``weight`` of a stage (the weight-gradient part of `backward`, the W op of zero-bubble
schedules; 0 = half of it); and of the profile: ``tensor_parallel`` (times and sizes are ONE
tensor-parallel rank's; 1 when left out), ``recompute`` (`RECOMPUTE_MODES`: the backward includes
recomputing that part of the forward) and ``seq_len``, ``precision``, ``model`` (what it was
measured at, like `micro_batch_size`; absent = unknown, and a run checks only what it records).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import yaml

from pipefisher.core.files import load_structured, write_text_atomically
from pipefisher.core.names import PRECISIONS, RECOMPUTE_MODES
from pipefisher.core.percentile import check_percentile, percentile
from pipefisher.methods.registry import DEFAULT_METHOD, methods


SCHEMA = "pipefisher.profile/v1"
#: stage times written only where non-zero (0 when a file leaves them out)
_OPTIONAL_STAGE_TIMES = ("step_end", "grad_reduce", "weight")
#: layer times a file may leave out (0)
_OPTIONAL_LAYER_TIMES = ("sync_a", "sync_b")
TIME_UNITS = ("s", "ms", "us", "units")


class ProfileError(ValueError):
    """A profile is malformed; the message names the field and how to fix it."""


class Samples(Mapping[str, tuple[float, ...]]):
    """Immutable, hashable mapping: time field -> its measured values (the field's unit)."""

    def __init__(self, values: Mapping[str, Iterable[float]] | None = None) -> None:
        self._values = {name: tuple(float(v) for v in vs) for name, vs in (values or {}).items()}

    def __getitem__(self, name: str) -> tuple[float, ...]:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._values.items())))

    def __repr__(self) -> str:
        return f"Samples({self._values!r})"


@dataclass(frozen=True)
class LayerProfile:
    """K-FAC costs of one Linear layer of a stage; `samples` and capture sizes as the module
    docstring says. A plain mapping given as `samples` is checked and stored as `Samples`."""

    TIME_FIELDS: ClassVar[tuple[str, ...]] = (
        "curvature_a",
        "curvature_b",
        "inverse_a",
        "inverse_b",
        "precondition",
        "sync_a",
        "sync_b",
    )
    BYTE_FIELDS: ClassVar[tuple[str, ...]] = ("capture_a_bytes", "capture_b_bytes")

    name: str
    curvature_a: float
    curvature_b: float
    inverse_a: float
    inverse_b: float
    precondition: float
    sync_a: float = 0.0
    sync_b: float = 0.0
    capture_a_bytes: int = 0
    capture_b_bytes: int = 0
    samples: Mapping[str, tuple[float, ...]] = field(default_factory=Samples)

    def __post_init__(self) -> None:
        object.__setattr__(self, "samples", _samples(self.samples, self.TIME_FIELDS, "samples"))

    def to_dict(self) -> dict[str, Any]:
        """The file's fields; capture sizes and samples only where given."""
        data: dict[str, Any] = {"name": self.name, **{key: getattr(self, key) for key in self.TIME_FIELDS}}
        data.update({key: getattr(self, key) for key in self.BYTE_FIELDS if getattr(self, key)})
        if self.samples:
            data["samples"] = {key: list(values) for key, values in self.samples.items()}
        return data


@dataclass(frozen=True)
class StageProfile:
    """Costs of one pipeline stage; `p2p` is the transfer time to the next stage; `grad_reduce`
    the all-reduce of the stage's gradient over its replicas, which starts once the stage's
    gradient is final (after its last backward, or its preconditioning) and overlaps the device's
    other work; `step_end` the rest of the stage's end of step after its last op (tied weights,
    clipping, optimizer step; in profiles without `grad_reduce`, the all-reduce too), which a
    device holding several stages pays once per stage. `samples` as in `LayerProfile`."""

    TIME_FIELDS: ClassVar[tuple[str, ...]] = ("forward", "backward", "p2p", "step_end", "grad_reduce", "weight")

    forward: float
    backward: float
    p2p: float = 0.0
    step_end: float = 0.0
    grad_reduce: float = 0.0
    layers: tuple[LayerProfile, ...] = ()
    samples: Mapping[str, tuple[float, ...]] = field(default_factory=Samples)
    #: the weight-gradient part of `backward` (0 = unknown: half of it)
    weight: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "samples", _samples(self.samples, self.TIME_FIELDS, "samples"))

    @property
    def weight_gradient(self) -> float:
        """Time of the weight gradient of one micro-batch when the backward is split."""
        return min(self.weight, self.backward) if self.weight else self.backward / 2

    @property
    def input_gradient(self) -> float:
        """Time of the input gradient of one micro-batch when the backward is split."""
        return self.backward - self.weight_gradient

    def to_dict(self) -> dict[str, Any]:
        """The file's fields; `step_end`, `grad_reduce` and samples only where given."""
        data: dict[str, Any] = {
            key: getattr(self, key)
            for key in self.TIME_FIELDS
            if key not in _OPTIONAL_STAGE_TIMES or getattr(self, key)
        }
        if self.samples:
            data["samples"] = {key: list(values) for key, values in self.samples.items()}
        data["layers"] = [layer.to_dict() for layer in self.layers]
        return data

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
    """Per-stage costs; `method`: the curvature method whose tasks the layers' times are
    (a name in `pipefisher.methods.registry`; written only when not `DEFAULT_METHOD`);
    `tensor_parallel`: the degree T whose per-rank (per-shard) work the times are; `recompute`: the
    activation recomputation the backward times include; `micro_batch_size`, `seq_len`,
    `precision`, `model`: what the times were measured at (None or "": unknown; module docstring)."""

    stages: tuple[StageProfile, ...]
    time_unit: str = "ms"
    device: str = ""
    micro_batch_size: int | None = None
    method: str = DEFAULT_METHOD
    tensor_parallel: int = 1
    recompute: str = "none"
    seq_len: int | None = None
    precision: str | None = None
    model: str = ""

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def require_stages(self, num_stages: int, hint: str = "") -> Profile:
        """Return self if it has `num_stages` stages, else raise ProfileError."""
        if self.num_stages != num_stages:
            raise ProfileError(
                f"profile has {self.num_stages} stages but the schedule needs {num_stages}"
                + (f" ({hint})" if hint else "")
            )
        return self

    def at_percentile(self, q: float) -> Profile:
        """This profile with every time field that has samples set to the q-th percentile of its
        samples (`percentile`); fields without samples, and all samples, unchanged. q = 50 gives
        the medians. ValueError unless 0 <= q <= 100."""
        check_percentile(q)
        stages = tuple(
            replace(_at_percentile(stage, q), layers=tuple(_at_percentile(layer, q) for layer in stage.layers))
            for stage in self.stages
        )
        return replace(self, stages=stages)

    def to_dict(self) -> dict[str, Any]:
        """The file's fields; optional ones only where given (files stay as before without them)."""
        data: dict[str, Any] = {"schema": SCHEMA, "device": self.device, "time_unit": self.time_unit}
        if self.micro_batch_size is not None:
            data["micro_batch_size"] = self.micro_batch_size
        if self.method != DEFAULT_METHOD:
            data["method"] = self.method
        if self.tensor_parallel > 1:
            data["tensor_parallel"] = self.tensor_parallel
        if self.recompute != "none":
            data["recompute"] = self.recompute
        data.update({key: getattr(self, key) for key in ("seq_len", "precision", "model") if getattr(self, key)})
        data["stages"] = [stage.to_dict() for stage in self.stages]
        return data

    def save(self, path: str | Path) -> None:
        """Write YAML, or JSON when the suffix is .json."""
        path = Path(path)
        data = self.to_dict()
        text = json.dumps(data, indent=1) if path.suffix == ".json" else yaml.safe_dump(data, sort_keys=False)
        write_text_atomically(path, text if text.endswith("\n") else text + "\n")


def uniform_profile(num_stages: int, forward: float = 1.0, backward: float = 2.0, p2p: float = 0.0) -> Profile:
    """Identical stages without K-FAC layers, in abstract time units."""
    stage = StageProfile(forward=forward, backward=backward, p2p=p2p)
    return Profile(stages=(stage,) * num_stages, time_unit="units", device="uniform")


Timed = TypeVar("Timed", LayerProfile, StageProfile)


def _at_percentile(item: Timed, q: float) -> Timed:
    times: dict[str, Any] = {key: percentile(values, q) for key, values in item.samples.items()}
    return replace(item, **times)


def _check_time(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ProfileError(f"{where}: {value!r} is not a finite number")
    if value < 0:
        raise ProfileError(f"{where}: {value} is negative; times must be >= 0")
    return float(value)


def _time(data: dict, key: str, where: str, required: bool = True) -> float:
    if key not in data:
        if required:
            raise ProfileError(f"{where}.{key}: missing; give a time in the profile's time_unit")
        return 0.0
    return _check_time(data[key], f"{where}.{key}")


def _bytes(data: dict, key: str, where: str) -> int:
    value = data.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ProfileError(f"{where}.{key}: {value!r} is not a non-negative integer (bytes)")
    return value


def _samples(data: Any, known: tuple[str, ...], where: str) -> Samples:
    """Checked samples: known time fields, each a non-empty list of finite times >= 0."""
    data = _mapping(data, where)
    for key, values in data.items():
        if key not in known:
            raise ProfileError(f"{where}.{key}: unknown time field; known: {', '.join(known)}")
        if not isinstance(values, (list, tuple)) or not values:
            raise ProfileError(f"{where}.{key}: expected a non-empty list of times")
        for i, value in enumerate(values):
            _check_time(value, f"{where}.{key}[{i}]")
    return data if isinstance(data, Samples) else Samples(data)


def _reject_unknown(data: dict, cls: type, where: str, extra: tuple[str, ...] = ()) -> None:
    known = {f.name for f in fields(cls)} | set(extra)
    unknown = sorted(set(data) - known)
    if unknown:
        raise ProfileError(f"{where}: unknown field {unknown[0]!r}; known fields are {', '.join(sorted(known))}")


def _mapping(value: Any, where: str) -> Mapping:
    if not isinstance(value, Mapping):
        raise ProfileError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def _layer(data: Any, where: str) -> LayerProfile:
    data = _mapping(data, where)
    _reject_unknown(data, LayerProfile, where)
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise ProfileError(f"{where}.name: missing; give the layer's module name")
    times: dict[str, Any] = {
        key: _time(data, key, where, required=key not in _OPTIONAL_LAYER_TIMES) for key in LayerProfile.TIME_FIELDS
    }
    sizes: dict[str, Any] = {key: _bytes(data, key, where) for key in LayerProfile.BYTE_FIELDS}
    samples = _samples(data.get("samples", {}), LayerProfile.TIME_FIELDS, f"{where}.samples")
    return LayerProfile(name=name, **times, **sizes, samples=samples)


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
    if _time(data, "weight", where, required=False) > _time(data, "backward", where):
        raise ProfileError(
            f"{where}.weight: {data['weight']} exceeds backward {data['backward']}; it is the weight-gradient part of the backward"
        )
    return StageProfile(
        forward=_time(data, "forward", where),
        backward=_time(data, "backward", where),
        p2p=_time(data, "p2p", where, required=False),
        step_end=_time(data, "step_end", where, required=False),
        grad_reduce=_time(data, "grad_reduce", where, required=False),
        weight=_time(data, "weight", where, required=False),
        layers=parsed,
        samples=_samples(data.get("samples", {}), StageProfile.TIME_FIELDS, f"{where}.samples"),
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
    degree = data.get("tensor_parallel", 1)
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        raise ProfileError(
            f"tensor_parallel: {degree!r} must be a positive integer (the tensor-parallel degree; 1 = none)"
        )
    method = data.get("method", DEFAULT_METHOD)
    if method not in methods():
        raise ProfileError(f"method: {method!r} is not one of {', '.join(methods())}")
    recompute = data.get("recompute", "none")
    if recompute not in RECOMPUTE_MODES:
        raise ProfileError(
            f"recompute: {recompute!r} is not one of {', '.join(RECOMPUTE_MODES)} (the run's model.recompute)"
        )
    seq_len = data.get("seq_len")
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1):
        raise ProfileError(f"seq_len: {seq_len!r} must be a positive integer (the run's model.seq_len)")
    precision = data.get("precision")
    if precision is not None and precision not in PRECISIONS:
        raise ProfileError(f"precision: {precision!r} is not one of {', '.join(PRECISIONS)} (the run's run.precision)")
    model = data.get("model", "")
    if not isinstance(model, str):
        raise ProfileError(f"model: {model!r} must be text naming the measured model, e.g. 'bert bert-base'")
    stages = data.get("stages")
    if not isinstance(stages, list) or not stages:
        raise ProfileError("stages: missing; give one entry per pipeline stage")
    return Profile(
        stages=tuple(_stage(stage, f"stages[{i}]") for i, stage in enumerate(stages)),
        time_unit=unit,
        device=str(data.get("device", "")),
        micro_batch_size=mbs,
        method=method,
        tensor_parallel=degree,
        recompute=recompute,
        seq_len=seq_len,
        precision=precision,
        model=model,
    )


def load_profile(path: str | Path) -> Profile:
    """Read a profile from YAML or JSON (JSON when the suffix is .json)."""
    return load_structured(path, "profile", profile_from_dict, ProfileError, schema=SCHEMA)
