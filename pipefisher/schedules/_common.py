"""Argument checks and assembly shared by the schedule generators."""

from __future__ import annotations

from collections.abc import Sequence

from pipefisher.core.ir import Op, Schedule, ScheduleError


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ScheduleError(message)


def check_sizes(name: str, num_stages: int, num_micro_batches: int) -> None:
    """Common limits: at least one stage and one micro-batch."""
    require(num_stages >= 1, f"{name}: stages D must be at least 1 (got {num_stages})")
    require(num_micro_batches >= 1, f"{name}: micro-batches N must be at least 1 (got {num_micro_batches})")


def single_pipe(
    name: str, num_stages: int, num_micro_batches: int, ranks: Sequence[Sequence[Op]], **params: int
) -> Schedule:
    """A schedule whose stage s lives on rank s (mod the number of ranks, for model chunks)."""
    num_ranks = len(ranks)
    return Schedule(
        name=name,
        num_stages=num_stages,
        num_micro_batches=num_micro_batches,
        placement={(0, stage): stage % num_ranks for stage in range(num_stages)},
        ranks=tuple(tuple(ops) for ops in ranks),
        params=dict(params),
    )
