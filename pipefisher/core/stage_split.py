"""Which blocks each pipeline stage of a model holds: dealt evenly, or as `pipeline.stage_blocks`
counts them. Pure Python."""

from __future__ import annotations

from itertools import accumulate


def stage_block_ranges(total: int, num_stages: int, counts: tuple[int, ...] = ()) -> list[range]:
    """The global indices of the blocks of each of `num_stages` stages, in order: `counts[i]` for
    stage i when given (one count per stage, each at least 1, summing to `total`), else `total /
    num_stages` each; ValueError naming what does not fit."""
    if counts:
        if len(counts) != num_stages or sum(counts) != total or min(counts) < 1:
            raise ValueError(
                f"stage_blocks: {list(counts)} is not {num_stages} counts of at least 1 block summing to {total}"
            )
    elif num_stages < 1 or total % num_stages:
        raise ValueError(f"num_stages: {num_stages} does not divide the {total} blocks")
    else:
        counts = (total // num_stages,) * num_stages
    ends = list(accumulate(counts, initial=0))
    return [range(start, end) for start, end in zip(ends, ends[1:])]
