"""The reader of version 1 of the profile format (`pipefisher.profile/v1`, written before a
method's work had parts by index): it turns a v1 file's content into the v2 fields it means.

A v1 layer names its two parts by letter: ``curvature_a``/``curvature_b``, ``sync_a``/``sync_b``
(optional), ``inverse_a``/``inverse_b`` (the refresh work of every method, whatever it computed)
and ``capture_a_bytes``/``capture_b_bytes``; they are parts 0 and 1 of ``curvature``, ``sync``,
``refresh`` and ``capture_bytes`` (their sample keys likewise: ``inverse_b`` is ``refresh.1``).
A v1 file that names no method was written by versions that knew K-FAC alone (`V1_METHOD`).
Pure Python.
"""

from __future__ import annotations

from typing import Any

from pipefisher.core.profile_checks import ProfileError, byte_count, mapping, time_field

SCHEMA_V1 = "pipefisher.profile/v1"
#: the compatibility rule of v1: a file without a `method` field holds the times of the K-FAC
#: tasks (the only method of the versions that wrote such files), by the name K-FAC registers
V1_METHOD = "kfac"
#: v1 layer field -> (v2 field, part)
_PARTS = {
    f"{v1}_{letter}": (v2, part)
    for v1, v2 in (("curvature", "curvature"), ("sync", "sync"), ("inverse", "refresh"))
    for part, letter in enumerate("ab")
}
_BYTES = {"capture_a_bytes": 0, "capture_b_bytes": 1}
_REQUIRED = ("curvature_a", "curvature_b", "inverse_a", "inverse_b", "precondition")
_KNOWN = ("name", "samples", *_PARTS, *_BYTES, "precondition")


def v2_key(key: str) -> str:
    """The v2 time key of v1 time field `key` (``inverse_a`` -> ``refresh.0``); others unchanged."""
    if key in _PARTS:
        work, part = _PARTS[key]
        return f"{work}.{part}"
    return key


def _layer(data: Any, where: str) -> dict[str, Any]:
    data = mapping(data, where)
    unknown = sorted(set(data) - set(_KNOWN))
    if unknown:
        raise ProfileError(f"{where}: unknown field {unknown[0]!r}; known fields are {', '.join(sorted(_KNOWN))}")
    layer: dict[str, Any] = {"name": data.get("name")}
    parts: dict[str, list[float]] = {"curvature": [0.0, 0.0], "sync": [0.0, 0.0], "refresh": [0.0, 0.0]}
    for key, (work, part) in _PARTS.items():
        parts[work][part] = time_field(data, key, where, required=key in _REQUIRED)
    layer.update(parts)
    layer["precondition"] = time_field(data, "precondition", where)
    layer["capture_bytes"] = [byte_count(data.get(key, 0), f"{where}.{key}") for key in _BYTES]
    samples = data.get("samples", {})
    if isinstance(samples, dict):
        layer["samples"] = {v2_key(key): values for key, values in samples.items()}
    else:
        layer["samples"] = samples
    return layer


def upgrade_v1(data: dict[str, Any]) -> dict[str, Any]:
    """The v2 content that v1 content `data` means (checked as far as v1 differs from v2; the
    v2 reader checks the rest)."""
    upgraded = dict(data)
    upgraded.setdefault("method", V1_METHOD)
    stages = data.get("stages")
    if isinstance(stages, list):
        upgraded["stages"] = []
        for i, stage in enumerate(stages):
            if isinstance(stage, dict) and isinstance(stage.get("layers"), list):
                layers = [_layer(layer, f"stages[{i}].layers[{j}]") for j, layer in enumerate(stage["layers"])]
                stage = {**stage, "layers": layers}
            upgraded["stages"].append(stage)
    return upgraded
