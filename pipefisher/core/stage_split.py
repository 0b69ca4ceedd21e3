"""Which blocks each pipeline stage of a model holds: dealt evenly, or as `pipeline.stage_blocks`
counts them. Pure Python."""

from __future__ import annotations

from collections.abc import Callable, Sequence
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


def even_counts(total: int, num_stages: int) -> tuple[int, ...]:
    """`total` blocks dealt evenly over `num_stages` (ValueError where they do not divide)."""
    return tuple(len(held) for held in stage_block_ranges(total, num_stages))


def balanced_counts(weights: Sequence[float], num_stages: int) -> tuple[int, ...]:
    """Blocks per stage that cut the blocks of `weights` (each block's time, in model order; a
    block's neighbours outside the blocks, such as the head, counted in the first or last block's)
    into `num_stages` contiguous stages of at least one block each, the slowest stage as fast as
    any cut allows; of those cuts, the one whose stage times have the least sum of squares (the
    most even), and of those the one with the fewest blocks on the earliest stages (they hold the
    most activations in flight). ValueError where there are fewer blocks than stages."""
    count = len(weights)
    if not 1 <= num_stages <= count:
        raise ValueError(f"num_stages: {num_stages} stages cannot each hold one of {count} blocks")
    ends = list(accumulate(weights, initial=0.0))

    def load(first: int, last: int) -> float:
        return ends[last] - ends[first]

    slowest = _least_slowest(load, count, num_stages)
    limit = slowest * (1 + 1e-9) + 1e-12
    # cost[k][i]: (sum of squares, counts) of the best cut of blocks i.. into k stages under `limit`
    inf: tuple[float, tuple[int, ...]] = (float("inf"), ())
    cost: list[list[tuple[float, tuple[int, ...]]]] = [[inf] * (count + 1) for _ in range(num_stages + 1)]
    cost[0][count] = (0.0, ())
    for stages in range(1, num_stages + 1):
        for first in range(count - stages, -1, -1):
            best = inf
            for last in range(first + 1, count - stages + 2):
                taken = load(first, last)
                if taken > limit:
                    break  # blocks take time: a longer stage only takes more
                rest_squares, rest = cost[stages - 1][last]
                if rest_squares == float("inf"):
                    continue
                found = (taken * taken + rest_squares, (last - first, *rest))
                if found[0] < best[0] * (1 - 1e-12) or (found[0] <= best[0] * (1 + 1e-12) and found[1] < best[1]):
                    best = found
            cost[stages][first] = best
    return cost[num_stages][0][1]


def _least_slowest(load: Callable[[int, int], float], count: int, num_stages: int) -> float:
    """The least time of the slowest stage over every contiguous cut (the linear partition problem);
    block times are not negative."""
    # slowest[k][i]: the least slowest stage of blocks i.. cut into k stages
    inf = float("inf")
    slowest = [[inf] * (count + 1) for _ in range(num_stages + 1)]
    slowest[0][count] = 0.0
    for stages in range(1, num_stages + 1):
        for first in range(count - stages, -1, -1):
            best = inf
            for last in range(first + 1, count - stages + 2):
                taken = load(first, last)
                if taken >= best:
                    break  # this stage only grows from here, and the rest only shrinks
                best = min(best, max(taken, slowest[stages - 1][last]))
            slowest[stages][first] = best
    return slowest[num_stages][0]


def counts_text(counts: Sequence[int]) -> str:
    """Blocks per stage in a few characters: ``3/1``, and a run of three or more equal counts as
    ``1x32`` (``1x32/2x32`` for 32 stages of one block, then 32 of two)."""
    runs: list[list[int]] = []
    for count in counts:
        if runs and runs[-1][0] == count:
            runs[-1][1] += 1
        else:
            runs.append([count, 1])
    parts = [f"{count}x{times}" if times >= 3 else "/".join([str(count)] * times) for count, times in runs]
    return "/".join(parts)
