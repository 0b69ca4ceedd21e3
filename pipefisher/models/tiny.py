"""A small pre-LayerNorm Transformer encoder (or MLP) for regression, cut into pipeline stages.

Every Linear is an explicit `nn.Linear` (attention included), so K-FAC hooks see all of them.
Stage i is built from seed (seed, i) alone: any rank, and the single-process reference, build
identical parameters for it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from pipefisher.config import ModelConfig


class SelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.output = nn.Linear(hidden, hidden)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, hidden = x.shape
        split = lambda t: t.view(batch, seq, self.heads, hidden // self.heads).transpose(1, 2)
        attended = nn.functional.scaled_dot_product_attention(split(self.query(x)), split(self.key(x)), split(self.value(x)))
        return self.output(attended.transpose(1, 2).reshape(batch, seq, hidden))


class Block(nn.Module):
    """Pre-LN Transformer block: x + attention(LN(x)), then x + FFN(LN(x))."""

    def __init__(self, hidden: int, heads: int, ffn: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden)
        self.attention = SelfAttention(hidden, heads)
        self.norm2 = nn.LayerNorm(hidden)
        self.intermediate = nn.Linear(hidden, ffn)
        self.output = nn.Linear(ffn, hidden)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.output(nn.functional.gelu(self.intermediate(self.norm2(x))))


class Dense(nn.Module):
    """MLP layer: tanh(Linear(x))."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.linear(x))


class Stage(nn.Module):
    """Consecutive layers of the model; the first stage embeds, the last one projects out."""

    def __init__(self, config: ModelConfig, layers: range, first: bool, last: bool):
        super().__init__()
        width = config.hidden
        self.embed = nn.Linear(config.input_dim, width) if first else None
        if config.kind == "transformer":
            self.blocks = nn.ModuleList(Block(width, config.heads, config.ffn) for _ in layers)
        else:
            self.blocks = nn.ModuleList(Dense(width) for _ in layers)
        self.norm = nn.LayerNorm(width) if last and config.kind == "transformer" else None
        self.head = nn.Linear(width, config.output_dim) if last else None

    def forward(self, x: Tensor | None, batch: dict[str, Tensor]) -> Tensor:
        if self.embed is not None:
            x = self.embed(batch["inputs"])
        for block in self.blocks:
            x = block(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.head is not None:
            x = self.head(x)
        return x


class _Seeded:
    """Context in which torch's default generator is seeded with `seed`, restored after."""

    def __init__(self, seed: int):
        self.seed = seed

    def __enter__(self) -> None:
        self.state = torch.random.get_rng_state()
        torch.manual_seed(self.seed)

    def __exit__(self, *exc) -> None:
        torch.random.set_rng_state(self.state)


class TinyRegression:
    """The staged-model interface (`pipefisher.models.StagedModel`) of the regression model."""

    loss_parts: tuple[str, ...] = ()

    def __init__(self, config: ModelConfig):
        self.config = config

    def build_stage(self, index: int, num_stages: int, seed: int) -> Stage:
        """Stage `index` of `num_stages` (layers split evenly), initialised from (seed, index)."""
        per_stage = self.config.layers // num_stages
        with _Seeded(seed * 1_000_003 + index):
            return Stage(self.config, range(index * per_stage, (index + 1) * per_stage), index == 0, index == num_stages - 1)

    def activation_shape(self, stage: int, num_stages: int, micro_batch_size: int) -> tuple[int, ...]:
        width = self.config.output_dim if stage == num_stages - 1 else self.config.hidden
        return (micro_batch_size, self.config.seq_len, width)

    def loss(self, output: Tensor, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        return nn.functional.mse_loss(output, batch["targets"]), {}

    def tied_parameters(self) -> list[tuple[str, str]]:
        return []

    def kfac_skip(self) -> tuple[str, ...]:
        return ()
