"""Chimera (Li & Hoefler, SC'21): two pipes in opposite directions over the same D ranks.

Pipe 0 ("down") holds stage s on rank s, pipe 1 ("up") on rank D−1−s; each rank holds one stage
of each pipe. Micro-batches come in blocks of D: the first D/2 of a block go down, the rest up.
Blocks are concatenated directly (the paper's basic scheme for N > D).
"""

from __future__ import annotations

from pipefisher.core.ir import Op, Schedule, backward, forward
from pipefisher.schedules._common import check_sizes, require

DOWN, UP = 0, 1


def _rank_order(rank: int, num_ranks: int, num_blocks: int) -> list[tuple[str, int]]:
    """("F" | "B", pipe) sequence of one rank, as in the paper's figure.

    Ranks in the first half start with the down pipe, ranks in the second half mirror them with
    the pipes swapped. Per block: `a` forwards of the near pipe, `b` pairs (far F, near F), `a`
    pairs (far F, far B), `b` pairs (near B, far B); from the second block on, each of the first
    `a` forwards is preceded by a near backward left from the previous block.
    """
    half = num_ranks // 2
    near, far = (DOWN, UP) if rank < half else (UP, DOWN)
    a = half - rank if rank < half else rank - half + 1
    b = half - a
    order: list[tuple[str, int]] = []
    for block in range(num_blocks):
        for _ in range(a):
            if block > 0:
                order.append(("B", near))
            order.append(("F", near))
        for _ in range(b):
            order += [("F", far), ("F", near)]
        for _ in range(a):
            order += [("F", far), ("B", far)]
        for _ in range(b):
            order += [("B", near), ("B", far)]
    order += [("B", near)] * a
    return order


def chimera(num_stages: int, num_micro_batches: int) -> Schedule:
    name = "chimera"
    check_sizes(name, num_stages, num_micro_batches)
    require(num_stages % 2 == 0, f"{name}: stages D must be even (got {num_stages}); try {num_stages + 1}")
    require(
        num_micro_batches % num_stages == 0,
        f"{name}: micro-batches N={num_micro_batches} must be a multiple of stages D={num_stages}; "
        f"try {num_stages * max(1, round(num_micro_batches / num_stages))}",
    )
    num_ranks, half = num_stages, num_stages // 2
    num_blocks = num_micro_batches // num_stages
    pipe_micro_batches = {
        pipe: [block * num_stages + pipe * half + i for block in range(num_blocks) for i in range(half)]
        for pipe in (DOWN, UP)
    }
    placement = {}
    for stage in range(num_stages):
        placement[(DOWN, stage)] = stage
        placement[(UP, stage)] = num_ranks - 1 - stage
    ranks: list[list[Op]] = []
    for rank in range(num_ranks):
        stage_of = {DOWN: rank, UP: num_ranks - 1 - rank}
        counters = {(kind, pipe): 0 for kind in "FB" for pipe in (DOWN, UP)}
        ops: list[Op] = []
        for kind, pipe in _rank_order(rank, num_ranks, num_blocks):
            micro_batch = pipe_micro_batches[pipe][counters[(kind, pipe)]]
            counters[(kind, pipe)] += 1
            make = forward if kind == "F" else backward
            ops.append(make(stage_of[pipe], micro_batch, pipe))
        ranks.append(ops)
    return Schedule(
        name=name,
        num_stages=num_stages,
        num_micro_batches=num_micro_batches,
        placement=placement,
        ranks=tuple(tuple(ops) for ops in ranks),
        num_pipes=2,
    )
