"""Synthetic regression micro-batches, a pure function of (seed, step, micro-batch id).

Targets come from a fixed random teacher: y = tanh(x W₁) W₂. Every rank can rebuild exactly the
micro-batch it needs, and the single-process reference sees the same data in the same order.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pipefisher.data.settings import DataConfig
from pipefisher.models.settings import ModelConfig


class SyntheticRegression:
    def __init__(self, data: DataConfig, model: ModelConfig):
        self.data, self.model = data, model
        generator = torch.Generator().manual_seed(data.seed * 7919 + 1)
        self.w1 = torch.randn(model.input_dim, model.hidden, generator=generator) / model.input_dim**0.5
        self.w2 = torch.randn(model.hidden, model.output_dim, generator=generator) / model.hidden**0.5

    def micro_batch(self, step: int, micro_batch: int) -> dict[str, Tensor]:
        """{"inputs", "targets"} of global micro-batch `micro_batch` of `step`: float32 CPU tensors."""
        generator = torch.Generator().manual_seed(((self.data.seed * 1_000_003 + step) * 1_000_003) + micro_batch)
        shape = (self.data.micro_batch_size, self.model.seq_len, self.model.input_dim)
        inputs = torch.randn(shape, generator=generator)
        targets = torch.tanh(inputs @ self.w1) @ self.w2
        return {"inputs": inputs, "targets": targets}
