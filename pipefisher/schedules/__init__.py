"""Pure schedule generators, a registry that resolves them by name, and each schedule's model
chunks per rank (the one place that says how many stages a schedule cuts the model into)."""

from __future__ import annotations

from collections.abc import Callable

from pipefisher.core.ir import Schedule, ScheduleError
from pipefisher.schedules import v_shape
from pipefisher.schedules.chimera import chimera
from pipefisher.schedules.dualpipev import dualpipev
from pipefisher.schedules.gpipe import gpipe
from pipefisher.schedules.interleaved import interleaved
from pipefisher.schedules.one_f_one_b import one_f_one_b
from pipefisher.schedules.zb_h1 import zb_h1
from pipefisher.schedules.zbv import zbv

SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "chimera": chimera,
    "zb-h1": zb_h1,
    "zbv": zbv,
    "dualpipev": dualpipev,
}

#: schedules whose chunks per rank the run chooses (`pipeline.chunks`, `--chunks`)
CONFIGURABLE_CHUNKS = frozenset({"interleaved"})
DEFAULT_CHUNKS = 2
#: schedules with a fixed number of chunks per rank other than 1 (the V placement)
_FIXED_CHUNKS = {"zbv": v_shape.CHUNKS, "dualpipev": v_shape.CHUNKS}


def _generator(name: str) -> Callable[..., Schedule]:
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}") from None


def chunks_per_rank(name: str, configured: int | None = None) -> int:
    """Model chunks (stages of one pipe) each rank holds under schedule `name`: `configured`
    (default 2) for interleaved, 2 for the V schedules (zbv, dualpipev), 1 otherwise. The model is
    cut into ranks × this many stages per pipe. ScheduleError for an unknown name."""
    _generator(name)
    if name in CONFIGURABLE_CHUNKS:
        return DEFAULT_CHUNKS if configured is None else configured
    return _FIXED_CHUNKS.get(name, 1)


def get_schedule(name: str, num_stages: int, num_micro_batches: int, chunks: int | None = None) -> Schedule:
    """Build the named schedule on `num_stages` ranks; `chunks` (chunks per rank) is chosen for
    interleaved only (default 2); for the others it may be left out or be their own count
    (`chunks_per_rank`)."""
    generator = _generator(name)
    if name in CONFIGURABLE_CHUNKS:
        return generator(num_stages, num_micro_batches, chunks=chunks_per_rank(name, chunks))
    own = chunks_per_rank(name)
    if chunks not in (None, own):
        raise ScheduleError(f"chunks apply to the interleaved schedule only, not {name!r} (it has {own} per rank)")
    return generator(num_stages, num_micro_batches)


__all__ = [
    "SCHEDULES",
    "CONFIGURABLE_CHUNKS",
    "chunks_per_rank",
    "get_schedule",
    "gpipe",
    "one_f_one_b",
    "interleaved",
    "chimera",
    "zb_h1",
    "zbv",
    "dualpipev",
]
