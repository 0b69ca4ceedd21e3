"""ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, Section 2.1, Figure 3 top):
1F1B with the backward split into the input gradient (B) and the weight gradient (W).

Stage s runs 1F1B's order of forwards and input gradients (warm-up D−s−1 forwards) and lets its
weight gradients lag its input gradients by s: W of micro-batch k follows B of micro-batch k + s,
and the last s weight gradients close the step, where 1F1B's cool-down leaves stage s idle.
"""

from __future__ import annotations

from pipefisher.core.ir import Op, OpKind, Schedule, weight
from pipefisher.schedules._common import check_sizes, single_pipe
from pipefisher.schedules.one_f_one_b import one_f_one_b_order


def zb_h1(num_stages: int, num_micro_batches: int) -> Schedule:
    """One stage per rank; any N ≥ 1.

    Contract (tests hold it; F, B, W the times of a forward, input gradient and weight gradient,
    equal on every stage, no p2p time): for N ≥ D every device idles (D−1)(F+B−W) per step, where
    1F1B idles (D−1)(F+B+W); this holds whenever W ≤ min(F, B) (the paper's handcrafted schedule
    assumes F = B = W, where it is a third of 1F1B's). Stage s holds at most D−s activations
    until their input gradient, as 1F1B, and at most D until their weight gradient (1F1B's peak,
    that of stage 0, on every stage: the paper's memory bound, its Section 2.1), with at most
    s+1 weight gradients pending.
    """
    name = "zb-h1"
    check_sizes(name, num_stages, num_micro_batches)
    ranks: list[list[Op]] = []
    for stage in range(num_stages):
        ops: list[Op] = []
        input_gradients = weights = 0
        for kind, k in one_f_one_b_order(num_micro_batches, num_stages - stage - 1):
            ops.append(Op(kind, stage, k))
            if kind is OpKind.BACKWARD:
                input_gradients += 1
                if input_gradients > stage:
                    ops.append(weight(stage, weights))
                    weights += 1
        ops += [weight(stage, k) for k in range(weights, num_micro_batches)]
        ranks.append(ops)
    return single_pipe(name, num_stages, num_micro_batches, ranks)
