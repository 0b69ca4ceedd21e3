"""DualPipeV (DeepSeek-V3 technical report, arXiv:2412.19437, Section 3.2.1, and DeepSeek's
DualPipe repository: DualPipe "cut in half"; PyTorch's ScheduleDualPipeV) on the V placement
(`v_shape`).

DualPipeV overlaps the forward of one chunk with the backward of the other on a rank to hide
communication; pipefisher does not model that overlap: an overlapped F&B step is its forward,
then its backward, in list order. A full backward is its input gradient followed at once by its
weight gradient; a split one (the zero-bubble steps) queues its weight gradient, and the queue is
drained oldest first where the order has room.

Rank r's order, in eight steps: 2(D−r−1) chunk-0 forwards; r+1 pairs (F0, F1); D−r−1 times
(split B1, oldest pending W, F1); N−2D+r+1 times (F0, full B1, F1, full B0); D−r−1 times (full B1,
F1, full B0); r+1 pairs (B1, B0), split from the middle pair on; D−r−1 times (oldest pending W,
split B0); the r+1 pending weight gradients.
"""

from __future__ import annotations

from collections import deque

from pipefisher.core.ir import OpKind, Schedule
from pipefisher.schedules._common import check_sizes, require
from pipefisher.schedules.v_shape import Token, v_schedule

F, B, W = OpKind.FORWARD, OpKind.BACKWARD, OpKind.WEIGHT


class _Order:
    """A rank's (kind, chunk) order under construction, with its queue of pending weight gradients."""

    def __init__(self) -> None:
        self.tokens: list[Token] = []
        self.pending: deque[int] = deque()

    def forward(self, chunk: int) -> None:
        self.tokens.append((F, chunk))

    def backward(self, chunk: int, split: bool) -> None:
        """The input gradient of `chunk`; its weight gradient now, or queued if `split`."""
        self.tokens.append((B, chunk))
        if split:
            self.pending.append(chunk)
        else:
            self.tokens.append((W, chunk))

    def oldest_weight(self) -> None:
        """The oldest queued weight gradient, if any."""
        if self.pending:
            self.tokens.append((W, self.pending.popleft()))


def _rank_order(rank: int, num_ranks: int, num_micro_batches: int) -> list[Token]:
    d, r, n = num_ranks, rank, num_micro_batches
    order = _Order()
    for _ in range(2 * (d - r - 1)):
        order.forward(0)
    for _ in range(r + 1):
        order.forward(0)
        order.forward(1)
    for _ in range(d - r - 1):
        order.backward(1, split=True)
        order.oldest_weight()
        order.forward(1)
    for _ in range(n - 2 * d + r + 1):
        order.forward(0)
        order.backward(1, split=False)
        order.forward(1)
        order.backward(0, split=False)
    for _ in range(d - r - 1):
        order.backward(1, split=False)
        order.forward(1)
        order.backward(0, split=False)
    middle = (r + 1) // 2
    for pair in range(r + 1):
        order.backward(1, split=pair > middle or (pair == middle and r % 2 == 1))
        order.backward(0, split=pair >= middle)
    for _ in range(d - r - 1):
        order.oldest_weight()
        order.backward(0, split=True)
    while order.pending:
        order.oldest_weight()
    return order.tokens


def dualpipev(num_stages: int, num_micro_batches: int) -> Schedule:
    """`num_stages` is the number of ranks D; the model is cut into 2D stages (V placement);
    N ≥ 2D, as DeepSeek's and PyTorch's implementations require.

    Contract (tests hold it; F = B = W = t per chunk on every stage, no p2p time): every device
    idles (D−1)·t per step, as under ZB-V (without the F&B overlap it is built for, DualPipeV's
    order gains nothing over ZB-V's); every rank holds at most 2D+1 chunk activations until their
    weight gradient (ZB-V's 2D plus one chunk: D + 1/2 whole-stage activations), and rank r at
    most r+1 pending weight gradients.
    """
    name = "dualpipev"
    check_sizes(name, num_stages, num_micro_batches)
    require(
        num_micro_batches >= 2 * num_stages,
        f"{name}: micro-batches N={num_micro_batches} must be at least 2 x stages D = {2 * num_stages}; try {2 * num_stages}",
    )
    orders = [_rank_order(rank, num_stages, num_micro_batches) for rank in range(num_stages)]
    return v_schedule(name, num_micro_batches, orders)
