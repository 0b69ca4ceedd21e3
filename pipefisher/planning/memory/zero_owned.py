"""ZeRO-1's optimizer bytes per owning replica of a stage (`pipefisher.planning.replicas.zero.shard_owners`),
computed once per stage shape, replica count and optimizer: a planner's layouts repeat them (the
middle stages of a pipeline are alike; schedules of one shape share their replicas). Pure Python:
no torch."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

from pipefisher.planning.replicas.zero import shard_owners

#: the most results kept; the cache starts afresh beyond it
_LIMIT = 4096


class _Stage(Protocol):
    """What is read of a `pipefisher.planning.memory.state.StageState`."""

    @property
    def parameters(self) -> tuple[int, ...]: ...

    @property
    def preconditioned(self) -> tuple[bool, ...]: ...

    def preconditions(self, index: int) -> bool: ...


class _Optimizer(Hashable, Protocol):
    """What is read of a `pipefisher.planning.memory.state.OptimizerState` (frozen: hashable)."""

    def tensor_bytes(self, numel: int, preconditioned: bool = True) -> int: ...


_PER_RUN: dict[tuple, tuple[int, ...]] = {}


def owned_optimizer_bytes(stage: _Stage, optimizer: _Optimizer, ranks: Sequence[int]) -> dict[int, int]:
    """Rank of `ranks` (the stage's replicas, ascending) -> the optimizer bytes of the parameters it
    owns under ZeRO-1: run r of the stage's contiguous runs belongs to ``ranks[r]``."""
    key = (stage.parameters, stage.preconditioned, len(ranks), optimizer)
    per_run = _PER_RUN.get(key)
    if per_run is None:
        found = [0] * len(ranks)
        for number, run in enumerate(shard_owners(stage.parameters, range(len(ranks)))):
            found[run] += optimizer.tensor_bytes(stage.parameters[number], stage.preconditions(number))
        if len(_PER_RUN) >= _LIMIT:
            _PER_RUN.clear()
        per_run = _PER_RUN[key] = tuple(found)
    return dict(zip(ranks, per_run))
