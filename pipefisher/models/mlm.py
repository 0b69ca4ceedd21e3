"""The masked-LM head's positions and loss, shared by pipefisher's BERT and Hugging Face's.

A BERT micro-batch may carry ``mlm_positions`` (B, P) int64: per sequence, the positions the MLM
head predicts, P fixed per run (`pipefisher.data.pretraining.PretrainingData.max_predictions`,
NVIDIA's ``max_predictions_per_seq``). Every labelled position (``mlm_labels`` != -100) appears
once; the rest of the row points at unlabelled positions. The last stage then applies the head
(transform and tied vocabulary decoder) to those P positions only, and the loss reads the labels
there; without ``mlm_positions`` the head runs on all T positions. Either way the loss and every
gradient are the same (unlabelled positions contribute nothing). The indices are built with the
micro-batch on the host and gathered on the device, so nothing in a step waits for the host
(boolean indexing would).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor
from torch.nn import functional as F

IGNORE_INDEX = -100
"""`mlm_labels` value at positions that are not predicted (PyTorch's cross-entropy default)."""
MLM_POSITIONS = "mlm_positions"


def at_mlm_positions(x: Tensor, batch: Mapping[str, Tensor]) -> Tensor:
    """`x` (B, T, ...) at the batch's MLM positions, (B, P, ...); `x` itself when it has none."""
    positions = batch.get(MLM_POSITIONS)
    if positions is None:
        return x
    if x.dim() > 2:  # gather whole rows: 3 ATen ops (take_along_dim would dispatch 5)
        positions = positions.view(*positions.shape, *(1,) * (x.dim() - 2)).expand(*positions.shape, *x.shape[2:])
    return x.gather(1, positions)


def mlm_loss(logits: Tensor, batch: Mapping[str, Tensor]) -> Tensor:
    """Masked-LM cross-entropy of `logits` (B, P or T, vocab) as `at_mlm_positions` places them:
    the mean over labelled positions of batch["mlm_labels"] (B, T), 0 when there are none."""
    labels = at_mlm_positions(batch["mlm_labels"], batch).reshape(-1)
    summed = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return summed / (labels != IGNORE_INDEX).sum().clamp(min=1)
