"""A model kind defined outside the package, the proof that a model is a plugin: a residual MLP
for the synthetic regression data, x + W₂·relu(W₁·x) per block, registered as `model.kind
residual`. It reads model.layers, hidden, input_dim and output_dim, the stages must divide its
layers, and it has no tensor-parallel split and no sizes for the layout planner.

Importing this module registers the kind (spawned ranks import it when they unpickle `pipelined`,
the worker function below); tests that only want it for a while use `registered()`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from pipefisher.config import RunConfig
from pipefisher.core.tensor_parallel import TensorParallelPlan
from pipefisher.models.init import build_initialised
from pipefisher.models.kind import ModelKind
from pipefisher.models.registry import register, unregister
from pipefisher.models.tiny import pytorch_default_init


class ResidualBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(torch.relu(self.up(x)))


class ResidualStage(nn.Module):
    """Blocks `blocks` (global indices); the first stage embeds, the last one projects out."""

    def __init__(self, model: Any, blocks: range, first: bool, last: bool):
        super().__init__()
        self.embed = nn.Linear(model.input_dim, model.hidden) if first else None
        self.blocks = nn.ModuleDict({str(i): ResidualBlock(model.hidden) for i in blocks})
        self.head = nn.Linear(model.hidden, model.output_dim) if last else None

    def forward(self, x: Tensor | None, batch: dict[str, Tensor]) -> Tensor:
        x = self.embed(batch["inputs"]) if self.embed is not None else x
        for block in self.blocks.values():
            x = block(x)
        return self.head(x) if self.head is not None else x


class ResidualRegression:
    """The staged-model interface (`pipefisher.models.StagedModel`) of the residual MLP."""

    loss_parts: tuple[str, ...] = ()

    def __init__(self, model: Any):
        self.model = model

    def build_stage(self, index: int, num_stages: int, seed: int) -> nn.Module:
        per_stage = self.model.layers // num_stages
        blocks = range(index * per_stage, (index + 1) * per_stage)
        return build_initialised(
            lambda: ResidualStage(self.model, blocks, index == 0, index == num_stages - 1), seed, pytorch_default_init
        )

    def activation_shape(self, stage: int, num_stages: int, micro_batch_size: int) -> tuple[int, ...]:
        width = self.model.output_dim if stage == num_stages - 1 else self.model.hidden
        return (micro_batch_size, self.model.seq_len, width)

    def loss(self, output: Tensor, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        return nn.functional.mse_loss(output, batch["targets"]), {}

    def tied_parameters(self) -> list[tuple[str, str]]:
        return []

    def first_order_linears(self) -> tuple[str, ...]:
        return ()

    def tensor_parallel_plan(self, degree: int) -> TensorParallelPlan:
        raise ValueError("kind: residual has no tensor-parallel split")

    def recompute_plan(self, mode: str) -> tuple[str, ...]:
        if mode == "selective":
            raise ValueError(
                "recompute: model.kind residual has no attention to recompute selectively; use blocks or none"
            )
        return {"none": (), "blocks": ("blocks.*",)}[mode]


def build(run: Any) -> ResidualRegression:
    """The kind's builder, given the run's parts (`RunParts`): its data is the synthetic regression data."""
    return ResidualRegression(run.config.model)


RESIDUAL = ModelKind(
    "residual",
    ("synthetic",),
    ("layers", "hidden", "input_dim", "output_dim"),
    lambda model: f"residual layers {model.layers} hidden {model.hidden}",
    f"{__name__}:build",
    blocks_key="layers",
    tensor_parallel=False,
)
register(RESIDUAL)


@contextmanager
def registered() -> Iterator[ModelKind]:
    """The kind known while the context lasts (this process only)."""
    register(RESIDUAL)
    try:
        yield RESIDUAL
    finally:
        unregister(RESIDUAL.name)


def pipelined(rank: int, world: int, config: RunConfig):
    """A rank's pipelined training of `config` (`_workers.pipelined`, from a module that registers the kind)."""
    from _workers import pipelined as train

    return train(rank, world, config)
