"""Numerics counters of SOAP matrices: incremented on the device, read on the host in one go.

Each matrix has an int64 vector with one counter per :class:`SoapHealth` field, in field order.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


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


#: positions of the counters in a matrix's vector (`pipefisher.methods.counters.zero_counters`)
SKIPPED_STATISTICS, KEPT_BASES = range(len(fields(SoapHealth)))


def message(name: str, values: tuple[int, ...]) -> str:
    """The warning for a matrix whose counters first rose to ``values``."""
    skipped, kept = values
    return (
        f"SOAP matrix {name!r}: {skipped} statistics update(s) skipped for a non-finite gradient, {kept} block "
        "eigenbasis(es) failed and kept the previous one; further trouble is only counted (see health())"
    )
