"""Interleaved 1F1B (Megatron-LM): each rank holds v model chunks; stage = chunk × D + rank."""

from __future__ import annotations

from pipefisher.core.ir import Op, OpKind, Schedule, backward, forward
from pipefisher.schedules._common import check_sizes, require, single_pipe
from pipefisher.schedules.one_f_one_b import one_f_one_b_order


def interleaved(num_stages: int, num_micro_batches: int, chunks: int = 2) -> Schedule:
    """`num_stages` is the number of ranks D; the model is cut into D × `chunks` stages.

    Micro-batches go through the chunks in groups of D (Megatron's order), so N must be a
    multiple of D. Rank r warms up with 2(D−r−1) + (v−1)D forwards; with one chunk this is
    plain 1F1B (warm-up D−r−1), as in Megatron.
    """
    name = "interleaved"
    check_sizes(name, num_stages, num_micro_batches)
    require(chunks >= 1, f"{name}: chunks must be at least 1 (got {chunks})")
    require(
        num_micro_batches % num_stages == 0,
        f"{name}: micro-batches N={num_micro_batches} must be a multiple of stages D={num_stages}; "
        f"try {num_stages * max(1, round(num_micro_batches / num_stages))}",
    )
    ranks_count, total = num_stages, num_micro_batches * chunks
    ranks: list[list[Op]] = []
    for rank in range(ranks_count):
        if chunks == 1:
            warmup = ranks_count - rank - 1
        else:
            warmup = 2 * (ranks_count - rank - 1) + (chunks - 1) * ranks_count
        order = one_f_one_b_order(total, warmup)
        ops: list[Op] = []
        for kind, k in order:
            group, lane = divmod(k, ranks_count)
            chunk = group % chunks
            micro_batch = (group // chunks) * ranks_count + lane
            if kind is OpKind.FORWARD:
                ops.append(forward(chunk * ranks_count + rank, micro_batch))
            else:
                ops.append(backward((chunks - 1 - chunk) * ranks_count + rank, micro_batch))
        ranks.append(ops)
    return single_pipe(name, ranks_count * chunks, num_micro_batches, ranks, chunks=chunks)
