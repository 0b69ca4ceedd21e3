"""Pure schedule generators and a registry that resolves them by name."""

from __future__ import annotations

from collections.abc import Callable

from pipefisher.ir import Schedule, ScheduleError
from pipefisher.schedules.chimera import chimera
from pipefisher.schedules.gpipe import gpipe
from pipefisher.schedules.interleaved import interleaved
from pipefisher.schedules.one_f_one_b import one_f_one_b

SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "chimera": chimera,
}


def get_schedule(name: str, num_stages: int, num_micro_batches: int, chunks: int | None = None) -> Schedule:
    """Build the named schedule; `chunks` applies to `interleaved` only (default 2)."""
    try:
        generator = SCHEDULES[name]
    except KeyError:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}") from None
    if name == "interleaved":
        return generator(num_stages, num_micro_batches, chunks=2 if chunks is None else chunks)
    if chunks not in (None, 1):
        raise ScheduleError(f"chunks apply to the interleaved schedule only, not {name!r}")
    return generator(num_stages, num_micro_batches)


__all__ = ["SCHEDULES", "get_schedule", "gpipe", "one_f_one_b", "interleaved", "chimera"]
