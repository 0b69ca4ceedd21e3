"""Numerics counters of SOAP matrices: incremented on the device, read on the host in one go.

Each matrix has an int64 vector with one counter per :class:`SoapHealth` field, in field order.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor


class SoapNumericsWarning(RuntimeWarning):
    """A SOAP matrix skipped a non-finite gradient or kept a previous eigenbasis."""


@dataclass(frozen=True)
class SoapHealth:
    """Numerical trouble of one matrix (host values): ``skipped_statistics`` counts statistics
    updates skipped for a non-finite gradient, ``kept_bases`` block eigenbases whose computation
    failed (non-finite statistic or result) and that kept the previous basis (the identity before
    the first)."""

    skipped_statistics: int = 0
    kept_bases: int = 0


COUNTERS: tuple[str, ...] = tuple(f.name for f in fields(SoapHealth))
SKIPPED_STATISTICS, KEPT_BASES = range(len(COUNTERS))


def zero_counters(device: torch.device) -> Tensor:
    """A fresh int64 vector of :data:`COUNTERS` on ``device``."""
    return torch.zeros(len(COUNTERS), dtype=torch.int64, device=device)


def message(name: str, values: tuple[int, ...]) -> str:
    """The warning for a matrix whose counters first rose to ``values``."""
    skipped, kept = values
    return (f"SOAP matrix {name!r}: {skipped} statistics update(s) skipped for a non-finite gradient, {kept} block "
            "eigenbasis(es) failed and kept the previous one; further trouble is only counted (see health())")
