"""ZeRO stage 1's layout: which replica of a stage owns (updates, keeps optimizer state for) each
of the stage's parameters. Pure Python: no torch.

Parameters are never cut: a stage's parameters, in their order, are split into contiguous runs,
one per replica, so that the largest run is as small as it can be. Contiguous runs make each
owner's gradients and parameters one slice of the stage's flat buffers (one reduce and one
broadcast per bucket, the way NCCL itself runs an uneven reduce-scatter and all-gather).
"""

from __future__ import annotations

from collections.abc import Sequence


def contiguous_shards(sizes: Sequence[int], parts: int) -> list[int]:
    """Cut `sizes` (element counts, in order) into `parts` contiguous runs with the smallest
    largest sum; returns `parts + 1` indices (run r is ``sizes[cuts[r]:cuts[r + 1]]``; a run may
    be empty when there are fewer sizes than parts)."""
    if parts < 1:
        raise ValueError(f"parts: expected >= 1, got {parts}")

    def runs_needed(capacity: int) -> list[int] | None:
        cuts, total = [0], 0
        for index, size in enumerate(sizes):
            if total + size > capacity and total > 0:
                cuts.append(index)
                total = 0
            total += size
        return cuts if len(cuts) <= parts else None

    low, high = max(sizes, default=0), sum(sizes)
    while low < high:  # the smallest capacity that needs at most `parts` runs
        middle = (low + high) // 2
        if runs_needed(middle) is None:
            low = middle + 1
        else:
            high = middle
    cuts = runs_needed(low) or [0]
    cuts += [len(sizes)] * (parts + 1 - len(cuts))
    return cuts


def shard_owners(sizes: Sequence[int], ranks: Sequence[int]) -> list[int]:
    """The owning rank of each parameter of a stage whose copies live on `ranks` (ascending):
    run r of `contiguous_shards` belongs to ``ranks[r]``."""
    cuts = contiguous_shards(sizes, len(ranks))
    return [ranks[run] for run in range(len(ranks)) for _ in range(cuts[run], cuts[run + 1])]
