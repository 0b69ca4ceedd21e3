"""Held-out documents: a share of a corpus that training never sees, for evaluation.

The split is by document (no held-out sentence shares a document with a trained one) and
deterministic: `round(share · n)` documents spread evenly over the corpus's order, the same for
every seed, so runs of different seeds are evaluated on the same text.
"""

from __future__ import annotations

from typing import Protocol

import torch


class MicroBatches(Protocol):
    def micro_batch(self, step: int, micro_batch: int) -> dict[str, torch.Tensor]: ...


def held_out_indices(count: int, share: float) -> list[int]:
    """Indices of the held-out documents among `count`: `round(share · count)` of them, evenly
    spread (index i is held out when floor((i + 1)·share') > floor(i·share'), share' = held/count)."""
    if not 0.0 <= share < 1.0:
        raise ValueError(f"holdout: {share} must be in [0, 1)")
    held = round(share * count)
    return [i for i in range(count) if (i + 1) * held // count > i * held // count]


def split_documents(documents: list[list[str]], share: float) -> tuple[list[list[str]], list[list[str]]]:
    """(training documents, held-out documents), each in corpus order; ValueError naming `holdout`
    when a side would be empty while `share` > 0."""
    held = set(held_out_indices(len(documents), share))
    if share > 0 and not 0 < len(held) < len(documents):
        raise ValueError(
            f"holdout: {share} of {len(documents)} documents leaves a side empty; use a share that holds out at least one"
        )
    train = [document for i, document in enumerate(documents) if i not in held]
    return train, [documents[i] for i in sorted(held)]


def evaluation_batches(data: MicroBatches, count: int) -> list[dict[str, torch.Tensor]]:
    """`count` micro-batches of `data` (built on the held-out documents): its micro-batches 0 ..
    count - 1 of step 0, a fixed set for a fixed data seed."""
    if count < 1:
        raise ValueError(f"need at least one evaluation micro-batch, got {count}")
    return [data.micro_batch(0, index) for index in range(count)]
