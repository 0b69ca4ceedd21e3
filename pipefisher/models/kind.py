"""A kind of model as the rest of pipefisher sees it: its declaration, read by the run file's
checks, the layout planner, the memory model, resumption and run assembly. Pure Python: no torch.

The parts that need torch or the planner (the builder, the planner's sizes, the activation
model's shape) are named by "module:function" strings and imported only when used, so the
declaration can be read by torch-free configuration and planning code without an import cycle.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: `model` keys every kind reads; `ModelKind.keys` lists the others a kind reads
COMMON_KEYS = ("kind", "seq_len", "recompute")


def _no_problem(model: Any) -> str:
    return ""


def _nothing_to_preload(model: Any) -> tuple[str, ...]:
    return ()


@dataclass(frozen=True)
class ModelKind:
    """One kind of model, the run file's `model.kind` `name`.

    `data`: the `data.kind`s it trains on, the first the usual one.
    `keys`: the `model` keys it reads beside `COMMON_KEYS`; one set by a run of another kind is
    refused (`pipefisher.config.applies`).
    `identity(model)`: the model in one line from its `ModelConfig` `model`, as a profile records
    what it measured ("transformer layers 4 hidden 32 ...", "hf gpt2-tiny").
    `builder`: "module:function" of `(run: RunParts) -> StagedModel`, `run` the run's parts
    (`pipefisher.runtime.training.assembly.RunParts`: its `config`, and its `text_data`, shared with
    the run's data source); ConfigError naming the key for what the run file cannot be built as; a
    model that reads text data calls `run.data_ready()` once its split is valid, before it reads
    `run.text_data`. Imports torch.
    `sizes`: "module:function" of `(config: RunConfig) -> ModelSizes`, the model as the layout
    planner takes it, read without building it, torch-free (PlanError naming the key); "" = the
    planner has nothing to plan (no attention blocks).
    `activation_shape`: "module:function" of `(config: RunConfig, model: StagedModel) ->
    ModelShape` for the per-rank memory model (ValueError naming `model.kind` for a model it does
    not cover); "" = not covered.
    `blocks_key`: the `model` key that counts its blocks, which the run's stages must divide,
    checked from the run file ("" = counted when built, which checks it then).
    `tensor_parallel`: whether it has a tensor-parallel plan (`StagedModel.tensor_parallel_plan`);
    `tensor_parallel_divides`: `model` keys the degree must divide, checked from the run file (the
    widths a built model reads from elsewhere are checked when built).
    `check(model)`: the problem of its `ModelConfig` `model` the kind alone decides, as one line
    naming the key ("" = none).
    `naming_keys`: keys whose values name the model (another value is another model, never a
    setting to change when a checkpoint resumes); the first one describes it ("bert bert-tiny").
    `instead`: what it reads instead of the keys of others, for the refusal's last words.
    `exports`: its checkpoints export as a Hugging Face model folder (`pipefisher export`).
    `uneven_splits`: its stages take `pipeline.stage_blocks` (blocks per stage) instead of an even
    split; the builder passes the counts to the model.
    `preload(model)`: modules a rank imports to build it (beyond torch and the trainer), which a
    launcher's forkserver imports once for all the ranks it forks
    (`pipefisher.runtime.training.launch.run_group`'s `preload`); one not installed is skipped.
    """

    name: str
    data: tuple[str, ...]
    keys: tuple[str, ...]
    identity: Callable[[Any], str]
    builder: str
    sizes: str = ""
    activation_shape: str = ""
    blocks_key: str = ""
    tensor_parallel: bool = True
    tensor_parallel_divides: tuple[str, ...] = ()
    check: Callable[[Any], str] = _no_problem
    naming_keys: tuple[str, ...] = ()
    instead: str = ""
    exports: bool = False
    uneven_splits: bool = False
    preload: Callable[[Any], tuple[str, ...]] = _nothing_to_preload

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or not self.data:
            raise ValueError(f"model kind {self.name!r}: needs an identifier for a name and at least one data kind")
        for key in (*self.keys, self.blocks_key, *self.tensor_parallel_divides, *self.naming_keys):
            if key in COMMON_KEYS:
                raise ValueError(f"model kind {self.name!r}: {key} is read by every kind; do not list it")
        if ":" not in self.builder:
            raise ValueError(f"model kind {self.name!r}: builder {self.builder!r} must be 'module:function'")

    def build(self, run: Any) -> Any:
        """The `StagedModel` of the run whose `RunParts` is `run` (imports the builder's module: torch)."""
        return load(self.builder)(run)

    def reads(self, key: str) -> bool:
        """Whether the kind reads `model` key `key` (a name without the section)."""
        return key in COMMON_KEYS or key in self.keys


def load(path: str) -> Callable[..., Any]:
    """The function "module:function" `path` names, imported now."""
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)
