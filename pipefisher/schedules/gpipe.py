"""GPipe: every stage runs all forwards, then all backwards, in micro-batch order."""

from __future__ import annotations

from pipefisher.core.ir import Schedule, backward, forward
from pipefisher.schedules._common import check_sizes, single_pipe


def gpipe(num_stages: int, num_micro_batches: int) -> Schedule:
    check_sizes("gpipe", num_stages, num_micro_batches)
    mbs = range(num_micro_batches)
    ranks = [[forward(stage, mb) for mb in mbs] + [backward(stage, mb) for mb in mbs] for stage in range(num_stages)]
    return single_pipe("gpipe", num_stages, num_micro_batches, ranks)
