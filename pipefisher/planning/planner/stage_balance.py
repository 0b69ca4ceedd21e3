"""The planner's uneven stage splits (`pipeline.stage_blocks`): the blocks of each pipeline piece
that balance the pieces' compute, the head and embeddings included. Pure Python: no torch.

A time source's profile at one block per piece gives each block's forward + backward time, the
first block's with the embeddings and the last's with the heads (the vocabulary projection); the
contiguous cut of those times into the layout's pieces with the least slowest piece
(`balanced_counts`) is the balanced split. Where the heads are light (or the source models none,
like the reference CSVs) it is the even split, and the planner tries only that.
"""

from __future__ import annotations

from typing import Protocol

from pipefisher.core.profile import Profile
from pipefisher.core.stage_split import balanced_counts, even_counts


class PieceTimes(Protocol):
    """A time source (`predict.TimeSource`) as the balance reads it."""

    def profile(
        self,
        pieces: int,
        micro_batch_size: int,
        tensor_parallel: int,
        split_backward: bool = False,
        stage_blocks: tuple[int, ...] = (),
    ) -> Profile: ...


def block_times(source: PieceTimes, blocks: int, micro_batch_size: int, tensor_parallel: int) -> tuple[float, ...]:
    """Forward + backward time of each block for one micro-batch (the source's unit), the first
    block's with the embeddings and the last's with the heads."""
    profile = source.profile(blocks, micro_batch_size, tensor_parallel)
    return tuple(stage.forward + stage.backward for stage in profile.stages)


def balanced_split(
    source: PieceTimes, blocks: int, pieces: int, micro_batch_size: int, tensor_parallel: int
) -> tuple[int, ...]:
    """Blocks per piece that balance the pieces' compute (module docstring); empty where that is
    the even split. ValueError where the pieces outnumber the blocks."""
    counts = balanced_counts(block_times(source, blocks, micro_batch_size, tensor_parallel), pieces)
    if blocks % pieces == 0 and counts == even_counts(blocks, pieces):
        return ()
    return counts
