"""A small pre-LayerNorm Transformer encoder (or MLP) for regression, cut into pipeline stages.

Every Linear is an explicit `nn.Linear` (attention included), so K-FAC hooks see all of them.
Module names are global, the same in every split, so the union of all stages' parameters is the
one-stage model's:

    embed                                                           first stage
    blocks.<i>.{norm1,attention.{query,key,value,output,core},      transformer block i
                norm2,intermediate,output}
    blocks.<i>.linear                                               MLP layer i
    norm (transformer only), head                                   last stage

with <i> the block's global index (stage 1 of 2 over 4 blocks holds blocks.2 and blocks.3).
Each module's parameters are drawn with PyTorch's default init from a generator seeded by
(seed, module name) alone, so every rank, the reference and any split build identical parameters.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from pipefisher.models import Batch
from pipefisher.models.settings import ModelConfig
from pipefisher.core.tensor_parallel import Split, TensorParallelPlan
from pipefisher.models.attention import AttentionCore
from pipefisher.models.init import build_initialised
from pipefisher.core.stage_split import stage_block_ranges


class SelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.head_size = hidden // heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.output = nn.Linear(hidden, hidden)
        self.core = AttentionCore()

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, _ = x.shape
        split = lambda t: t.view(batch, seq, -1, self.head_size).transpose(
            1, 2
        )  # a shard's heads under tensor parallelism
        attended = self.core(split(self.query(x)), split(self.key(x)), split(self.value(x)))
        return self.output(attended.transpose(1, 2).flatten(2))


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
    """Layers `layers` of the model, keyed by global index; the first stage embeds, the last one projects out."""

    def __init__(self, config: ModelConfig, layers: range, first: bool, last: bool):
        super().__init__()
        width = config.hidden
        self.embed = nn.Linear(config.input_dim, width) if first else None
        if config.kind == "transformer":
            self.blocks = nn.ModuleDict({str(i): Block(width, config.heads, config.ffn) for i in layers})
        else:
            self.blocks = nn.ModuleDict({str(i): Dense(width) for i in layers})
        self.norm = nn.LayerNorm(width) if last and config.kind == "transformer" else None
        self.head = nn.Linear(width, config.output_dim) if last else None

    def forward(self, x: Tensor | None, batch: dict[str, Tensor]) -> Tensor:
        if self.embed is not None:
            x = self.embed(batch["inputs"])
        if x is None:
            raise ValueError("x: a stage without embeddings needs the previous stage's hidden states")
        for block in self.blocks.values():
            x = block(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.head is not None:
            x = self.head(x)
        return x


def pytorch_default_init(module: nn.Module, generator: torch.Generator) -> None:
    """PyTorch's default init drawn from `generator`: Linear weight kaiming-uniform (a=sqrt 5) then
    bias U(±1/sqrt fan_in); LayerNorm weight 1, bias 0."""
    if isinstance(module, nn.Linear):
        nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5), generator=generator)
        if module.bias is not None:
            bound = 1 / math.sqrt(module.in_features)
            nn.init.uniform_(module.bias, -bound, bound, generator=generator)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)
    else:
        raise TypeError(f"no initialisation for {type(module).__name__}")


class TinyRegression:
    """The staged-model interface (`pipefisher.models.StagedModel`) of the regression model."""

    loss_parts: tuple[str, ...] = ()

    def __init__(self, config: ModelConfig, stage_blocks: tuple[int, ...] = ()):
        self.config, self.stage_blocks = config, stage_blocks

    def build_stage(self, index: int, num_stages: int, seed: int) -> Stage:
        """Stage `index` of `num_stages` (layers split evenly, or `stage_blocks` of them per stage);
        each parameter depends on (seed, its global name) alone. Does not touch the global RNG."""
        layers = stage_block_ranges(self.config.layers, num_stages, self.stage_blocks)[index]
        return build_initialised(
            lambda: Stage(self.config, layers, index == 0, index == num_stages - 1), seed, pytorch_default_init
        )

    def activation_shape(self, stage: int, num_stages: int, micro_batch_size: int) -> tuple[int, ...]:
        width = self.config.output_dim if stage == num_stages - 1 else self.config.hidden
        return (micro_batch_size, self.config.seq_len, width)

    def loss(self, output: Tensor, batch: Batch) -> tuple[Tensor, dict[str, Tensor]]:
        return nn.functional.mse_loss(output, batch["targets"]), {}

    def tied_parameters(self) -> list[tuple[str, str]]:
        return []

    def first_order_linears(self) -> tuple[str, ...]:
        return ()

    def tensor_parallel_plan(self, degree: int) -> TensorParallelPlan:
        """Megatron's split of every transformer block (`pipefisher.core.tensor_parallel`); the
        embedding, final norm and head stay whole. The run file's checks ensure `degree` divides
        the heads and the feed-forward width; an MLP has no plan (ValueError)."""
        if self.config.kind != "transformer":
            raise ValueError(f"kind: {self.config.kind} has no tensor-parallel split")
        block = "blocks.*."
        return {f"{block}attention.{name}": Split.COLUMN for name in ("query", "key", "value")} | {
            f"{block}attention.output": Split.ROW,
            f"{block}intermediate": Split.COLUMN,
            f"{block}output": Split.ROW,
        }

    def recompute_plan(self, mode: str) -> tuple[str, ...]:
        """Modules `model.recompute` `mode` checkpoints: blocks: every block (an MLP's layers);
        selective: every block's attention core; ValueError for an MLP's selective (no attention)."""
        if mode == "selective" and self.config.kind != "transformer":
            raise ValueError(
                f"recompute: model.kind {self.config.kind} has no attention to recompute selectively; use blocks or none"
            )
        return {"none": (), "blocks": ("blocks.*",), "selective": ("blocks.*.attention.core",)}[mode]
