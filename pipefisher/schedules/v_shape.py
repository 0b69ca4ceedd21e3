"""The V placement shared by ZB-V and DualPipeV: D ranks, 2D stages, two chunks per rank.

Stage s lives on rank s for s < D and on rank 2D−1−s for s ≥ D: rank r holds chunk 0 (stage r)
and chunk 1 (stage 2D−1−r). A micro-batch runs down the ranks through chunk 0 and back up
through chunk 1; stages D−1 and D share the last rank, so that boundary is a local hand-off,
and rank 0 holds both the first stage and the last (the loss).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from pipefisher.core.ir import Op, OpKind, Schedule

CHUNKS = 2

#: one entry of a rank's order: an op kind on chunk 0 or 1; micro-batches are counted per entry
Token = tuple[OpKind, int]


def v_stage(rank: int, chunk: int, num_ranks: int) -> int:
    """The stage that `rank` holds as `chunk` (0 or 1)."""
    return rank if chunk == 0 else 2 * num_ranks - 1 - rank


def v_placement(num_ranks: int) -> dict[tuple[int, int], int]:
    """(pipe 0, stage) -> rank for the 2D stages of the V."""
    return {(0, v_stage(rank, chunk, num_ranks)): rank for rank in range(num_ranks) for chunk in range(CHUNKS)}


def v_schedule(name: str, num_micro_batches: int, orders: Sequence[Sequence[Token]]) -> Schedule:
    """The schedule whose rank r runs `orders[r]` on the V placement (D = len(orders)).

    The k-th (kind, chunk) token of a rank's order is that kind of op of micro-batch k on that
    chunk's stage. Tokens that count past the last micro-batch are dropped, so an order may be
    written for more micro-batches than the step has (as ZB-V's is, for short steps).
    """
    num_ranks = len(orders)
    ranks: list[list[Op]] = []
    for rank, order in enumerate(orders):
        counts: Counter[Token] = Counter()
        ops: list[Op] = []
        for kind, chunk in order:
            micro_batch = counts[(kind, chunk)]
            counts[(kind, chunk)] += 1
            if micro_batch < num_micro_batches:
                ops.append(Op(kind, v_stage(rank, chunk, num_ranks), micro_batch))
        ranks.append(ops)
    return Schedule(
        name=name,
        num_stages=CHUNKS * num_ranks,
        num_micro_batches=num_micro_batches,
        placement=v_placement(num_ranks),
        ranks=tuple(tuple(ops) for ops in ranks),
        params={"chunks": CHUNKS},
    )
