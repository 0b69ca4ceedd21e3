"""Numerics counters of Shampoo matrices: incremented on the device, read on the host in one go.

Each (matrix, factor) has an int64 vector with one counter per :class:`ShampooHealth` field, in
field order: ``update_statistics`` and ``compute_root`` add device values to it (no host read).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields

import torch
from torch import Tensor


class ShampooNumericsWarning(RuntimeWarning):
    """A Shampoo matrix skipped a non-finite gradient or kept a previous root."""


@dataclass(frozen=True)
class ShampooHealth:
    """Numerical trouble of one matrix (host values): ``skipped_statistics`` counts factor
    statistics updates skipped for a non-finite captured gradient (one per factor),
    ``skipped_roots`` counts block roots that failed (non-finite or failed decomposition) and
    kept the previous one."""

    skipped_statistics: int = 0
    skipped_roots: int = 0


COUNTERS: tuple[str, ...] = tuple(f.name for f in fields(ShampooHealth))
SKIPPED_STATISTICS, SKIPPED_ROOTS = range(len(COUNTERS))


def zero_counters(device: torch.device) -> Tensor:
    """A fresh int64 vector of :data:`COUNTERS` on ``device``."""
    return torch.zeros(len(COUNTERS), dtype=torch.int64, device=device)


def total(values: Iterable[tuple[int, ...]]) -> ShampooHealth:
    """The :class:`ShampooHealth` of a matrix from the counter values of its factors."""
    sums = [sum(column) for column in zip(*values)] or [0] * len(COUNTERS)
    return ShampooHealth(*sums)


def message(name: str, factor: str, values: tuple[int, ...]) -> str:
    """The warning for a (matrix, factor) whose counters first rose to ``values``."""
    nonfinite, skipped = values
    return (
        f"Shampoo matrix {name!r}, factor {factor}: {nonfinite} statistics update(s) skipped for a non-finite "
        f"gradient, {skipped} block root(s) failed and kept the previous root; "
        "further trouble is only counted (see health())"
    )
