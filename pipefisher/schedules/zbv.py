"""ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", arXiv:2401.10241v2, Section 6; Qi et al.,
"Pipeline Parallelism with Controllable Memory", NeurIPS 2024; PyTorch's ScheduleZBVZeroBubble):
the zero-bubble schedule on the V placement (`v_shape`), backward split into B and W.

Rank r's order, with n = max(N, 2D−1) micro-batches (ops of micro-batches beyond N dropped):
warm-up 2(D−r)−1 chunk-0 forwards, r pairs (F chunk 1, F chunk 0), D−r triples F B W on chunk 1;
then n−D rounds of F0 B0 W0 F1 B1 W1 (F0 while chunk 0 has forwards left); cool-down r pairs
(B0, B1), D−r pairs (B0, W0), then the r pending chunk-1 and the r pending chunk-0 weight
gradients.
"""

from __future__ import annotations

from pipefisher.core.ir import OpKind, Schedule
from pipefisher.schedules._common import check_sizes
from pipefisher.schedules.v_shape import Token, v_schedule

F, B, W = OpKind.FORWARD, OpKind.BACKWARD, OpKind.WEIGHT


def _rank_order(rank: int, num_ranks: int, num_micro_batches: int) -> list[Token]:
    """Rank `rank`'s (kind, chunk) order for `num_micro_batches` ≥ 2D−1."""
    d, r, n = num_ranks, rank, num_micro_batches
    order: list[Token] = [(F, 0)] * (2 * (d - r) - 1) + [(F, 1), (F, 0)] * r + [(F, 1), (B, 1), (W, 1)] * (d - r)
    forwards_left = n - (2 * d - r - 1)
    for round_ in range(n - d):
        if round_ < forwards_left:
            order.append((F, 0))
        order += [(B, 0), (W, 0), (F, 1), (B, 1), (W, 1)]
    order += [(B, 0), (B, 1)] * r + [(B, 0), (W, 0)] * (d - r)
    return order + [(W, 1)] * r + [(W, 0)] * r


def zbv(num_stages: int, num_micro_batches: int) -> Schedule:
    """`num_stages` is the number of ranks D; the model is cut into 2D stages (V placement).

    Any N ≥ 1. Contract (tests hold it; F = B = W = t per chunk on every stage, no p2p time): for
    N ≥ 2D−1 every device idles (D−1)·t per step: with a whole stage's F = B = W = T (t = T/2),
    (D−1)·T/2, half of ZB-H1's (D−1)·T and a sixth of 1F1B's 3(D−1)·T. Every rank holds at most 2D
    chunk activations until their weight gradient, i.e. D whole-stage activations: 1F1B's peak
    (stage 0's); rank r has at most 2r+1 weight gradients pending.
    """
    name = "zbv"
    check_sizes(name, num_stages, num_micro_batches)
    n = max(num_micro_batches, 2 * num_stages - 1)
    orders = [_rank_order(rank, num_stages, n) for rank in range(num_stages)]
    return v_schedule(name, num_micro_batches, orders)
