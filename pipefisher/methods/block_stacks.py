"""Same-shape blocks of many matrices as one batch (`pipefisher.methods.blocks.block_groups`
chooses them): one batched product per group instead of one per block."""

from __future__ import annotations

import torch
from torch import Tensor


def stack(tensors: list[Tensor]) -> Tensor:
    """`tensors` (equal shapes) as one ``(b, ...)`` stack, or a lone one as it is (2-D products)."""
    return tensors[0] if len(tensors) == 1 else torch.stack(tensors)


def unstack(stacked: Tensor, count: int) -> list[Tensor]:
    """The `count` tensors of a `stack` result."""
    return [stacked] if count == 1 else list(stacked.unbind(0))
