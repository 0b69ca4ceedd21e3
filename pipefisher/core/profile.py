"""The stable profile format `pipefisher.profile/v2`: per-stage and per-layer op times.

All times are in the profile's `time_unit` (ms by default). Forward, backward and curvature times
are per micro-batch; sync and refresh times per refresh; precondition, fold, gradient reduction
and step end per step.
Loading checks every field and names the bad one (e.g. ``stages[1].layers[0].refresh``).

A layer's times are those of its `method`'s tasks, whose work has parts 0..n-1 (the method's
declaration names them: K-FAC's A and B factors, Shampoo's left and right roots): ``curvature``,
``sync`` and ``refresh`` are lists by part index (a part past a list's end takes 0), and
``precondition`` one time. ``capture_bytes`` (a list by part: the bytes one micro-batch's capture
holds; 0 or absent = unknown). The key of one part's time is ``<work>.<part>`` (`time_key`:
``refresh.1``), which is how ``samples`` (the measured repeats of each time field, whose median
the field is; ``Profile.at_percentile(q)`` takes their q-th percentile instead) and the methods'
timers name it.

Optional additions, each absent from files written before it (read as before; docs/profile-format.md
has every field): ``samples`` of a stage or layer; ``fold`` of a layer (its share of the method's
per-step fold of the gradient into its statistics, SOAP's U op; 0 when absent, and written only
where non-zero); ``weight`` of a stage (the weight-gradient part of `backward`, the W op of
zero-bubble schedules; 0 = half of it); and of the profile:
``tensor_parallel`` (times and sizes are ONE tensor-parallel rank's; 1 when left out),
``recompute`` (`RECOMPUTE_MODES`: the backward includes recomputing that part of the forward) and
``seq_len``, ``precision``, ``model``, ``tf32`` (what it was measured at, like
`micro_batch_size`; absent = unknown, and a run checks only what it records); ``flops`` of a layer and ``flop_rates``
(`pipefisher.core.profile_flops`: the flops of its tasks, the device's FLOP/s they compare with).

Version 1 files (`pipefisher.profile/v1`, layer times by letter: ``curvature_a``, ``inverse_b``)
are read unchanged through `pipefisher.core.profile_v1`; files are written as v2.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import yaml

from pipefisher.core.files import load_structured, write_text_atomically
from pipefisher.core.names import PRECISIONS, RECOMPUTE_MODES
from pipefisher.core.percentile import check_percentile, percentile
from pipefisher.core.profile_flops import FlopRates, check_flops
from pipefisher.core.profile_checks import (
    ProfileError,
    Samples,
    byte_count,
    check_samples,
    check_time,
    mapping,
    part_list,
    reject_unknown,
    time_field,
)
from pipefisher.core.profile_v1 import SCHEMA_V1, upgrade_v1
from pipefisher.core.layer_profile import PART_WORK, LayerProfile, flop_key, layer_key
from pipefisher.core.layer_profile import time_key as time_key  # re-exported: the profile format names its keys

SCHEMA = "pipefisher.profile/v2"
#: stage times written only where non-zero (0 when a file leaves them out)
_OPTIONAL_STAGE_TIMES = ("step_end", "grad_reduce", "weight", "method_step_end")
TIME_UNITS = ("s", "ms", "us", "units")


@dataclass(frozen=True)
class StageProfile:
    """Costs of one pipeline stage; `p2p` is the transfer time to the next stage; `grad_reduce`
    the all-reduce of the stage's gradient over its replicas, which starts once the stage's
    gradient is final (after its last backward, or its preconditioning) and overlaps the device's
    other work; `step_end` the rest of the stage's end of step after its last op (tied weights,
    clipping, optimizer step; in profiles without `grad_reduce`, the all-reduce too), which a
    device holding several stages pays once per stage, and of it `method_step_end` the method's
    own work there (Shampoo's, SOAP's preconditioning; 0 = none or not measured); `p2p_bytes` the
    size of the message `p2p` times (0 = unknown). `samples` as in `LayerProfile`."""

    TIME_FIELDS: ClassVar[tuple[str, ...]] = (
        "forward", "backward", "p2p", "step_end", "grad_reduce", "weight", "method_step_end"
    )  # fmt: skip

    forward: float
    backward: float
    p2p: float = 0.0
    step_end: float = 0.0
    grad_reduce: float = 0.0
    layers: tuple[LayerProfile, ...] = ()
    samples: Mapping[str, tuple[float, ...]] = field(default_factory=Samples)
    #: the weight-gradient part of `backward` (0 = unknown: half of it)
    weight: float = 0.0
    method_step_end: float = 0.0
    p2p_bytes: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "samples", check_samples(self.samples, self.TIME_FIELDS.__contains__, "samples"))

    def with_times(self, times: Mapping[str, float]) -> StageProfile:
        """This stage with the times of `times` (keyed by field) replaced."""
        changes: dict[str, Any] = dict(times)
        return replace(self, **changes)

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
        if self.p2p_bytes:
            data["p2p_bytes"] = self.p2p_bytes
        if self.samples:
            data["samples"] = {key: list(values) for key, values in self.samples.items()}
        data["layers"] = [layer.to_dict() for layer in self.layers]
        return data

    @property
    def curvature_time(self) -> float:
        """The curvature of every part of all layers for one micro-batch."""
        return sum(sum(layer.curvature) for layer in self.layers)

    @property
    def refresh_time(self) -> float:
        """The refresh work of every part of all layers, once."""
        return sum(sum(layer.refresh) for layer in self.layers)


@dataclass(frozen=True)
class Profile:
    """Per-stage costs; `method`: the name of the curvature method whose tasks the layers' times
    are ("" = none said; a v1 file without one reads as `V1_METHOD`'s);
    `tensor_parallel`: the degree T whose per-rank (per-shard) work the times are; `recompute`: the
    activation recomputation the backward times include; `micro_batch_size`, `seq_len`,
    `precision`, `model`: what the times were measured at (None or "": unknown; module docstring);
    `tf32`: whether CUDA float32 products ran on TF32 tensor cores (`run.tf32`; None: unknown, or
    not measured on CUDA, where it changes nothing); `flop_rates`: what the layers' `flops` per time are compared with (None: nothing)."""

    stages: tuple[StageProfile, ...]
    time_unit: str = "ms"
    device: str = ""
    micro_batch_size: int | None = None
    method: str = ""
    tensor_parallel: int = 1
    recompute: str = "none"
    seq_len: int | None = None
    precision: str | None = None
    model: str = ""
    flop_rates: FlopRates | None = None
    tf32: bool | None = None

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def link_speed(self) -> float:
        """Bytes per time unit of the pipeline's links: the stages' measured messages (`p2p_bytes`)
        over their `p2p` times; 0 when no stage has both."""
        timed = [(stage.p2p_bytes, stage.p2p) for stage in self.stages if stage.p2p_bytes and stage.p2p > 0]
        return sum(size for size, _ in timed) / sum(time for _, time in timed) if timed else 0.0

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
        if self.method:
            data["method"] = self.method
        if self.tensor_parallel > 1:
            data["tensor_parallel"] = self.tensor_parallel
        if self.recompute != "none":
            data["recompute"] = self.recompute
        data.update({key: getattr(self, key) for key in ("seq_len", "precision", "model") if getattr(self, key)})
        if self.tf32 is not None:
            data["tf32"] = self.tf32
        if self.flop_rates is not None:
            data["flop_rates"] = self.flop_rates.to_dict()
        data["stages"] = [stage.to_dict() for stage in self.stages]
        return data

    def save(self, path: str | Path) -> None:
        """Write YAML, or JSON when the suffix is .json."""
        path = Path(path)
        data = self.to_dict()
        text = json.dumps(data, indent=1) if path.suffix == ".json" else yaml.safe_dump(data, sort_keys=False)
        write_text_atomically(path, text if text.endswith("\n") else text + "\n")


def uniform_profile(num_stages: int, forward: float = 1.0, backward: float = 2.0, p2p: float = 0.0) -> Profile:
    """Identical stages without curvature layers, in abstract time units."""
    stage = StageProfile(forward=forward, backward=backward, p2p=p2p)
    return Profile(stages=(stage,) * num_stages, time_unit="units", device="uniform")


Timed = TypeVar("Timed", LayerProfile, StageProfile)


def _at_percentile(item: Timed, q: float) -> Timed:
    times: dict[str, Any] = {key: percentile(values, q) for key, values in item.samples.items()}
    return item.with_times(times)


def _layer(data: Any, where: str) -> LayerProfile:
    data = mapping(data, where)
    reject_unknown(data, LayerProfile, where)
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise ProfileError(f"{where}.name: missing; give the layer's module name")
    parts: dict[str, Any] = {work: part_list(data, work, where, check_time) for work in PART_WORK}
    return LayerProfile(
        name=name,
        **parts,
        precondition=time_field(data, "precondition", where, required=False),
        fold=time_field(data, "fold", where, required=False),
        capture_bytes=part_list(data, "capture_bytes", where, byte_count),
        weight_bytes=byte_count(data.get("weight_bytes", 0), f"{where}.weight_bytes"),
        samples=check_samples(data.get("samples", {}), layer_key, f"{where}.samples"),
        flops=check_flops(data.get("flops", {}), flop_key, f"{where}.flops"),
    )


def _stage(data: Any, where: str) -> StageProfile:
    data = mapping(data, where)
    reject_unknown(data, StageProfile, where)
    layers = data.get("layers") or []
    if not isinstance(layers, list):
        raise ProfileError(f"{where}.layers: expected a list of layers")
    parsed = tuple(_layer(layer, f"{where}.layers[{i}]") for i, layer in enumerate(layers))
    names = [layer.name for layer in parsed]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise ProfileError(f"{where}.layers: layer name {duplicate!r} appears twice")
    if time_field(data, "weight", where, required=False) > time_field(data, "backward", where):
        raise ProfileError(
            f"{where}.weight: {data['weight']} exceeds backward {data['backward']}; it is the weight-gradient part of the backward"
        )
    return StageProfile(
        forward=time_field(data, "forward", where),
        backward=time_field(data, "backward", where),
        p2p=time_field(data, "p2p", where, required=False),
        step_end=time_field(data, "step_end", where, required=False),
        grad_reduce=time_field(data, "grad_reduce", where, required=False),
        weight=time_field(data, "weight", where, required=False),
        method_step_end=_method_step_end(data, where),
        p2p_bytes=byte_count(data.get("p2p_bytes", 0), f"{where}.p2p_bytes"),
        layers=parsed,
        samples=check_samples(data.get("samples", {}), StageProfile.TIME_FIELDS.__contains__, f"{where}.samples"),
    )


def _method_step_end(data: Mapping[str, Any], where: str) -> float:
    value = time_field(data, "method_step_end", where, required=False)
    if value > time_field(data, "step_end", where, required=False):
        raise ProfileError(
            f"{where}.method_step_end: {value} exceeds step_end; it is the method's part of the step end"
        )
    return value


def profile_from_dict(data: Any) -> Profile:
    """The profile of a file's content, v2 or v1 (a file without `schema` is v1's)."""
    data = mapping(data, "profile")
    reject_unknown(data, Profile, "profile", extra=("schema",))
    schema = data.get("schema", SCHEMA_V1)
    if schema not in (SCHEMA, SCHEMA_V1):
        raise ProfileError(f"schema: {schema!r} is not supported; expected {SCHEMA!r} or {SCHEMA_V1!r}")
    if schema == SCHEMA_V1:
        data = upgrade_v1(dict(data))
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
    method = data.get("method", "")
    if not isinstance(method, str) or not (method == "" or method.isidentifier()):
        raise ProfileError(f"method: {method!r} must be the name of a curvature method (an identifier)")
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
    tf32 = data.get("tf32")
    if tf32 is not None and not isinstance(tf32, bool):
        raise ProfileError(f"tf32: {tf32!r} must be true or false (the run's run.tf32)")
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
        flop_rates=FlopRates.from_dict(data["flop_rates"]) if "flop_rates" in data else None,
        tf32=tf32,
    )


def load_profile(path: str | Path) -> Profile:
    """Read a profile from YAML or JSON (JSON when the suffix is .json)."""
    return load_structured(path, "profile", profile_from_dict, ProfileError, schema=SCHEMA)
