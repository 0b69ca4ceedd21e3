"""Numerics counters of K-FAC layers: incremented on the device, read on the host in one go.

Each (layer, factor) has an int64 vector with one counter per :class:`Health` field, in field
order. ``invert`` adds device bools to it (no host read); inspection stacks every vector of an
engine and reads them with a single ``tolist()``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import fields

import torch
from torch import Tensor

from pipefisher.methods.kfac.layer import Factor, Health

COUNTERS: tuple[str, ...] = tuple(f.name for f in fields(Health))


def zero_counters(device: torch.device) -> Tensor:
    """A fresh int64 vector of :data:`COUNTERS` on ``device``."""
    return torch.zeros(len(COUNTERS), dtype=torch.int64, device=device)


def count(counters: Tensor, **flags: Tensor) -> None:
    """Add each 0-dim device bool of ``flags`` (keyed by counter name) to its counter, in place."""
    for name, flag in flags.items():
        counters[COUNTERS.index(name)].add_(flag)


def total(values: Iterable[tuple[int, ...]]) -> Health:
    """The :class:`Health` of a layer from the counter values of its factors."""
    sums = [sum(column) for column in zip(*values)] or [0] * len(COUNTERS)
    return Health(*sums)


def message(counter: str, factor: Factor, method: str, damping: float, dtype: torch.dtype) -> str:
    """The warning for one increment of ``counter`` of ``factor``."""
    if counter == "nonfinite_factor":
        return f"non-finite {factor} factor; keeping the previous inverse"
    if counter == "failed_inverse":
        return (
            f"{method} inverse of {factor} failed (decomposition failed or non-finite result); "
            "keeping the previous inverse"
        )
    return f"damping {damping:g} is below {dtype} resolution for factor {factor}"
