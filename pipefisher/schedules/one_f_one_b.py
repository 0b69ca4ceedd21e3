"""1F1B (PipeDream-Flush): warm-up forwards, then one forward / one backward, then cool-down."""

from __future__ import annotations

from pipefisher.core.ir import Op, OpKind, Schedule
from pipefisher.schedules._common import check_sizes, single_pipe

F, B = OpKind.FORWARD, OpKind.BACKWARD


def one_f_one_b_order(num_micro_batches: int, num_warmup: int) -> list[tuple[OpKind, int]]:
    """(FORWARD | BACKWARD, k) sequence: `num_warmup` forwards, alternate F/B, then the remaining
    backwards.

    k counts forwards and backwards separately; at most num_warmup + 1 forwards are unmatched.
    """
    warmup = min(num_warmup, num_micro_batches)
    order = [(F, k) for k in range(warmup)]
    for k in range(num_micro_batches - warmup):
        order += [(F, warmup + k), (B, k)]
    order += [(B, k) for k in range(num_micro_batches - warmup, num_micro_batches)]
    return order


def one_f_one_b(num_stages: int, num_micro_batches: int) -> Schedule:
    """Stage s warms up with D−s−1 forwards, so it holds at most D−s activations at once."""
    check_sizes("1f1b", num_stages, num_micro_batches)
    ranks: list[list[Op]] = []
    for stage in range(num_stages):
        order = one_f_one_b_order(num_micro_batches, num_stages - stage - 1)
        ranks.append([Op(kind, stage, k) for kind, k in order])
    return single_pipe("1f1b", num_stages, num_micro_batches, ranks)
